"""flowtrain.host_memory: glibc keeps a step's freed memory, so the next step does not fault it
in again; a user's own allocator settings are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowtrain import host_memory

ROOT = Path(__file__).resolve().parents[1]

# A tensor of argv[2] MiB, allocated, freed and allocated again, as a step's activations are:
# where it lies (the heap or a mapping of its own), whether the heap shrank when it was freed,
# and how many minor page faults allocating and filling it took once the heap had settled.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "keep":
        from flowtrain import host_memory
        print(host_memory.keep_freed_memory())
    else:
        print(False)
    def heap():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
        return 0, 0
    numel = int(sys.argv[2]) * 2**20 // 4
    tensor = torch.ones(numel)
    lo, hi = heap()
    print(lo <= tensor.data_ptr() < hi)
    del tensor
    print(heap()[1] == hi)
    for _ in range(3):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensor = torch.ones(numel)
        del tensor
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
""")


def _probe(mode: str, mib: int = 30, **env: str) -> tuple[bool, bool, bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if k not in host_memory._USER_SETTINGS and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(mib)], capture_output=True,
                         text=True, timeout=120, check=True, cwd=ROOT,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}).stdout.split()
    applied, on_heap, kept = (word == "True" for word in out[:3])
    return applied, on_heap, kept, int(out[3])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("mib", [30, 200])
def test_freed_memory_stays_on_the_heap_for_reuse(mib: int) -> None:
    # 200 MiB: above the largest mmap threshold glibc accepts (32 MiB), as a 50k-vocabulary
    # head's logits are
    applied, on_heap, kept, faults = _probe("keep", mib)
    assert applied
    # on the heap, and still there after the free: the next step reuses it without faults
    assert on_heap and kept
    pages = mib * 2**20 // 4096
    assert faults < pages // 10, (faults, pages)
    # glibc's default maps a tensor this size on its own and unmaps it when freed
    _, on_heap_by_default, _, faults_by_default = _probe("default", mib)
    assert not on_heap_by_default
    if mib > 32:
        # above the 32 MiB ceiling of glibc's adaptive mmap threshold, every allocation is
        # mapped and faults its pages in again (below it, a free raises the threshold and
        # later allocations may come from the heap)
        assert faults_by_default >= pages * 9 // 10, (faults_by_default, pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_users_malloc_setting_is_left_alone() -> None:
    applied, on_heap, _, _ = _probe("keep", MALLOC_TOP_PAD_="131072")
    assert not applied and not on_heap


@pytest.mark.parametrize("env,reason", [
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
    ({}, None),
])
def test_user_has_chosen(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                         reason: str | None) -> None:
    for name in (*host_memory._USER_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_memory.user_has_chosen() == reason
