"""The shared-memory channel: sums equal torch's, are bit-identical on every rank, large tensors
go through in chunks, and a missing peer ends in a timeout that names it."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flowtrain.shm import ShmChannel, ShmTimeout, available

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not available(), reason="/dev/shm is not writable here")]

SIZES = [1, 7, 1000, 40_003]  # 40_003 floats > the 64 KiB slot: several chunks
SLOT = 64 * 1024


def _with_peers(channel: ShmChannel, path: Path, world: int, peer: Any, args: tuple[Any, ...],
                tmp_path: Path, run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``run`` on rank 0's ``channel`` while ranks 1.. run ``peer(path, rank, world, *args,
    out)`` in processes of their own, each saving its results to ``tmp_path/<rank>.pt``; the
    channel and its file are gone afterwards."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=peer, args=(str(path), r, world, *args,
                                            str(tmp_path / f"{r}.pt")))
             for r in range(1, world)]
    try:
        for p in procs:
            p.start()
        mine = run()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        channel.close()
        path.unlink(missing_ok=True)
        for p in procs:
            p.kill()
    return mine


def _tensors(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _peer(path: str, rank: int, world: int, dtype: torch.dtype, out: str) -> None:
    channel = ShmChannel(path, rank=rank, world_size=world, slot_bytes=SLOT, create=False,
                         timeout=20)
    results = [channel.all_reduce(t) for t in _tensors(rank, dtype)]
    torch.save(results, out)
    channel.close()


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.float32),
                                         (2, torch.bfloat16)])
def test_all_reduce_matches_torch_sum_on_every_rank(tmp_path: Path, world: int,
                                                    dtype: torch.dtype) -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-{world}"
    channel = ShmChannel(path, rank=0, world_size=world, slot_bytes=SLOT, create=True, timeout=20)
    mine = _with_peers(channel, path, world, _peer, (dtype,), tmp_path,
                       lambda: [channel.all_reduce(t) for t in _tensors(0, dtype)])
    inputs = [_tensors(r, dtype) for r in range(world)]
    for i in range(len(SIZES)):
        expected = inputs[0][i] + inputs[1][i]
        for r in range(2, world):
            expected = expected + inputs[r][i]
        assert torch.equal(mine[i], expected)
        for r in range(1, world):
            assert torch.equal(torch.load(tmp_path / f"{r}.pt")[i], mine[i])  # bit-identical


def test_missing_peer_times_out_naming_it() -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-timeout"
    channel = ShmChannel(path, rank=0, world_size=2, slot_bytes=SLOT, create=True, timeout=0.3)
    try:
        with pytest.raises(ShmTimeout, match=r"ranks \[1\] did not write its contribution"):
            channel.all_reduce(torch.ones(4))
    finally:
        channel.close()
        path.unlink(missing_ok=True)


def test_bad_tensors_and_sizes_are_refused(tmp_path: Path) -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-bad"
    channel = ShmChannel(path, rank=0, world_size=2, slot_bytes=SLOT, create=True)
    try:
        with pytest.raises(ValueError, match="contiguous CPU tensors"):
            channel.all_reduce_async(torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="ranks disagree on the channel size"):
            ShmChannel(path, rank=1, world_size=2, slot_bytes=2 * SLOT, create=False)
    finally:
        channel.close()
        path.unlink(missing_ok=True)


ARENA = 4 * 40_003 * len(SIZES) + 64 * 8


def _arena_run(channel: ShmChannel, rank: int) -> list[torch.Tensor]:
    """Each tensor of ``_tensors`` through the arena (scaled by 0.5), interleaved with a plain
    all-reduce, then again after ``quiesce`` and zeroing, as the engine does every step."""
    allocate = channel.arena_allocator()
    inputs = _tensors(rank, torch.float32)
    allocated = [allocate(t.numel(), t.dtype) for t in inputs]
    held = [buf for buf in allocated if buf is not None]
    assert len(held) == len(inputs), "the arena could not hold every tensor"
    results = []
    for _ in range(2):
        for buf, t in zip(held, inputs):
            assert channel.arena_offset(buf) is not None
            buf.copy_(t)
        futures = [channel.all_reduce_async(buf, scale=0.5) for buf in held]
        plain = channel.all_reduce(torch.full((5,), float(rank)))
        for f in futures:
            f.result()
        results = [buf.clone() for buf in held] + [plain]
        channel.quiesce()
        for buf in held:
            buf.zero_()
    return results


def _arena_peer(path: str, rank: int, world: int, out: str) -> None:
    channel = ShmChannel(path, rank=rank, world_size=world, slot_bytes=SLOT, create=False,
                         timeout=20, arena_bytes=ARENA)
    torch.save(_arena_run(channel, rank), out)
    channel.close()


@pytest.mark.parametrize("world", [2, 3])
def test_arena_all_reduce_matches_the_slot_path_bit_for_bit(tmp_path: Path, world: int) -> None:
    """Tensors in the arena are reduced without a slot copy, each rank summing its share: the
    results equal the rank-order sum times the scale on every rank, bit for bit."""
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-arena{world}"
    channel = ShmChannel(path, rank=0, world_size=world, slot_bytes=SLOT, create=True, timeout=20,
                         arena_bytes=ARENA)
    mine = _with_peers(channel, path, world, _arena_peer, (), tmp_path,
                       lambda: _arena_run(channel, 0))
    inputs = [_tensors(r, torch.float32) for r in range(world)]
    for i in range(len(SIZES)):
        expected = inputs[0][i] + inputs[1][i]
        for r in range(2, world):
            expected = expected + inputs[r][i]
        assert torch.equal(mine[i], expected * 0.5)
        for r in range(1, world):
            assert torch.equal(torch.load(tmp_path / f"{r}.pt")[i], mine[i])
    assert torch.equal(mine[-1], torch.full((5,), float(sum(range(world)))))


def _gather_run(channel: ShmChannel, rank: int, world: int) -> list[torch.Tensor]:
    """All-gathers of a shard that is the flat buffer's own slice and of a separate one, the
    second larger than a slot (several chunks)."""
    results = []
    for k, in_place in ((7, True), (SLOT // 4 + 5, False)):
        flat = torch.zeros(k * world)
        mine = torch.arange(k, dtype=torch.float32) + 1000.0 * rank
        if in_place:
            shard = flat[rank * k:(rank + 1) * k]
            shard.copy_(mine)
        else:
            shard = mine
        channel.all_gather_async(flat, shard).result()
        results.append(flat)
    return results


def _gather_peer(path: str, rank: int, world: int, out: str) -> None:
    channel = ShmChannel(path, rank=rank, world_size=world, slot_bytes=SLOT, create=False,
                         timeout=20)
    torch.save(_gather_run(channel, rank, world), out)
    channel.close()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_puts_every_shard_everywhere(tmp_path: Path, world: int) -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-gather{world}"
    channel = ShmChannel(path, rank=0, world_size=world, slot_bytes=SLOT, create=True, timeout=20)
    mine = _with_peers(channel, path, world, _gather_peer, (), tmp_path,
                       lambda: _gather_run(channel, 0, world))
    for i, k in enumerate((7, SLOT // 4 + 5)):
        expected = torch.cat([torch.arange(k, dtype=torch.float32) + 1000.0 * r
                              for r in range(world)])
        assert torch.equal(mine[i], expected)
        for r in range(1, world):
            assert torch.equal(torch.load(tmp_path / f"{r}.pt")[i], expected)


SHARED = 4096  # bytes of the host-shared region in the tests below


def _shared_run(channel: ShmChannel, rank: int, world: int) -> list[torch.Tensor]:
    """Each rank writes its slice of the shared region, then barriers, then reads the whole
    region: after the barrier every rank sees every slice. Three rounds, each rewriting the
    slices with new values after a barrier that orders the reads before the writes."""
    region = channel.shared_region().view(torch.float32)
    per = region.numel() // world
    seen = []
    for step in range(3):
        channel.barrier_async().result(timeout=20)  # the previous round's reads are done
        region[rank * per:(rank + 1) * per].fill_(100.0 * step + rank)
        channel.barrier_async().result(timeout=20)  # every slice written
        seen.append(region.clone())
    return seen


def _shared_peer(path: str, rank: int, world: int, out: str) -> None:
    channel = ShmChannel(path, rank=rank, world_size=world, slot_bytes=SLOT, create=False,
                         timeout=20, shared_bytes=SHARED)
    torch.save(_shared_run(channel, rank, world), out)
    channel.close()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_region_is_one_memory_ordered_by_barriers(tmp_path: Path, world: int) -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-shared{world}"
    channel = ShmChannel(path, rank=0, world_size=world, slot_bytes=SLOT, create=True,
                         timeout=20, shared_bytes=SHARED)
    mine = _with_peers(channel, path, world, _shared_peer, (), tmp_path,
                       lambda: _shared_run(channel, 0, world))
    per = SHARED // 4 // world
    for step in range(3):
        expected = torch.zeros(SHARED // 4)
        for r in range(world):
            expected[r * per:(r + 1) * per] = 100.0 * step + r
        assert torch.equal(mine[step], expected)
        for r in range(1, world):
            assert torch.equal(torch.load(tmp_path / f"{r}.pt")[step], expected)


def test_barrier_waits_for_every_rank_and_names_the_missing_one() -> None:
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-barrier"
    channel = ShmChannel(path, rank=0, world_size=2, slot_bytes=SLOT, create=True, timeout=0.3,
                         shared_bytes=SHARED)
    try:
        future = channel.barrier_async()
        with pytest.raises(ShmTimeout, match=r"ranks \[1\] did not reach the barrier"):
            future.result(timeout=5)
    finally:
        channel.close()
        path.unlink(missing_ok=True)
    bare = ShmChannel(path, rank=0, world_size=2, slot_bytes=SLOT, create=True, timeout=0.3)
    try:
        with pytest.raises(ValueError, match="without a shared region"):
            bare.shared_region()
    finally:
        bare.close()
        path.unlink(missing_ok=True)


def _voluntary_switches(thread_id: int) -> int:
    for line in Path(f"/proc/self/task/{thread_id}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


@pytest.mark.parametrize("poll", [False, True])
def test_a_waiting_rank_sleeps_until_its_peer_arrives(monkeypatch: pytest.MonkeyPatch,
                                                      poll: bool) -> None:
    """Rank 0 waits 0.3 s for rank 1 (two channels of one process): asleep on the flag (futex)
    its thread wakes a handful of times; polling, every few hundred microseconds. The sum is
    right either way."""
    if poll:
        monkeypatch.setenv("FLOWTRAIN_SHM_POLL", "1")
    else:
        monkeypatch.delenv("FLOWTRAIN_SHM_POLL", raising=False)
    path = Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-sleep-{poll}"
    first = ShmChannel(path, rank=0, world_size=2, slot_bytes=SLOT, create=True, timeout=20)
    second = ShmChannel(path, rank=1, world_size=2, slot_bytes=SLOT, create=False, timeout=20)
    try:
        if not poll and first._futex is None:
            pytest.skip("no futex system call here")
        a, b = torch.arange(10.0), torch.ones(10)
        waiting = first.all_reduce_async(a)
        time.sleep(0.05)  # rank 0 is in its wait now
        before = _voluntary_switches(first._thread.native_id or 0)
        time.sleep(0.3)
        woke = _voluntary_switches(first._thread.native_id or 0) - before
        second.all_reduce(b)
        waiting.result(10)
        assert torch.equal(a, torch.arange(10.0) + 1) and torch.equal(a, b)
        if poll:
            assert woke > 100, f"polling woke only {woke} times: the test measures nothing"
        else:
            # the sleep is cut into naps of 50 ms (a peer's lost wake-up costs no more)
            assert woke < 20, f"the waiting rank woke {woke} times in 0.3 s"
    finally:
        first.close()
        second.close()
        path.unlink(missing_ok=True)


def _channel_path() -> Path:
    return Path("/dev/shm") / f"flowtrain-test-{os.getpid()}-{os.urandom(4).hex()}"


def test_creating_a_channel_claims_its_pages() -> None:
    # a sparse tmpfs file would be found too big for /dev/shm only by a write, with SIGBUS
    path = _channel_path()
    channel = ShmChannel(path, rank=0, world_size=2, slot_bytes=4 * 2**20, create=True,
                         timeout=5.0, shared_bytes=8 * 2**20)
    try:
        stat = os.stat(path)
        assert stat.st_blocks * 512 >= stat.st_size >= 16 * 2**20
    finally:
        channel.close()
        path.unlink(missing_ok=True)


@pytest.fixture
def no_room_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm full: claiming a channel's pages fails as the kernel fails it."""
    import errno

    from flowtrain import shm

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)


def test_too_little_room_in_dev_shm_is_an_error_that_names_the_sizes(
        no_room_in_dev_shm: None) -> None:
    from flowtrain import shm

    path = _channel_path()
    with pytest.raises(shm.ShmSpaceError) as info:
        ShmChannel(path, rank=0, world_size=2, slot_bytes=2**20, create=True, timeout=5.0,
                   arena_bytes=3 * 2**20, shared_bytes=5 * 2**20)
    message = str(info.value)
    assert "needs 13 MiB" in message and "MiB free" in message
    assert "2 slots of 1.0 MiB" in message and "2 gradient arenas of 3.0 MiB" in message
    assert "the host's parameters, 5.0 MiB" in message
    assert "--shm-size" in message and '"data_channel": "torch"' in message
    assert not path.exists()  # nothing left behind in /dev/shm
    # sizes below a MiB are not rounded to "0.0 MiB"
    with pytest.raises(shm.ShmSpaceError) as info:
        ShmChannel(path, rank=0, world_size=2, slot_bytes=128, create=True, timeout=5.0,
                   arena_bytes=3 * 2**10)
    assert "2 slots of 128 bytes" in str(info.value)
    assert "2 gradient arenas of 3.0 KiB" in str(info.value)


class _HostRank:
    """What open_channel needs of a flowtrain rank: its place on the host and the control
    plane's key-value store, here a dict the host's ranks share."""

    def __init__(self, local_rank: int, store: dict[str, Any]) -> None:
        from types import SimpleNamespace

        self.env = SimpleNamespace(local_rank=local_rank, local_world_size=2, node_rank=0)
        self.store = store

    def kv_set(self, key: str, value: Any) -> None:
        self.store[key] = value

    def kv_get(self, key: str, timeout: float = 1.0) -> Any:
        return self.store[key]

    def barrier(self, name: str, timeout: float = 1.0) -> None:
        pass


def test_no_room_in_dev_shm_falls_back_on_every_rank_or_raises(
        no_room_in_dev_shm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain import shm

    store: dict[str, Any] = {}
    opened = shm._opened
    # local rank 0 finds there is no room and tells rank 1 through the channel's key
    assert shm.open_channel(_HostRank(0, store), slot_bytes=2**20, timeout=1.0,
                            fallback=True) is None
    assert list(store.values()) == [""]
    monkeypatch.setattr(shm, "_opened", opened)  # rank 1's process numbers its channels alike
    assert shm.open_channel(_HostRank(1, store), slot_bytes=2**20, timeout=1.0,
                            fallback=True) is None
    # without fallback (data_channel "shm" asked for by name) it is the error
    with pytest.raises(shm.ShmSpaceError, match="MiB free"):
        shm.open_channel(_HostRank(0, {}), slot_bytes=2**20, timeout=1.0)
