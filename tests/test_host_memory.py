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

# A 30 MiB tensor, allocated, freed and allocated again, as a step's activations are: where it
# lies (the heap or a mapping of its own), and whether the heap shrank when it was freed.
PROBE = textwrap.dedent("""
    import sys, torch
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
    tensor = torch.ones(30 * 2**20 // 4)
    lo, hi = heap()
    print(lo <= tensor.data_ptr() < hi)
    del tensor
    print(heap()[1] == hi)
""")


def _probe(mode: str, **env: str) -> list[bool]:
    clean = {k: v for k, v in os.environ.items()
             if k not in host_memory._USER_SETTINGS and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT,
                         env={**clean, "PYTHONPATH": str(ROOT), **env}).stdout.split()
    return [word == "True" for word in out]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_on_the_heap_for_reuse() -> None:
    applied, on_heap, kept = _probe("keep")
    assert applied
    # on the heap, and still there after the free: the next step reuses it without faults
    assert on_heap and kept
    # glibc's default maps a tensor this size on its own and unmaps it when freed: every
    # allocation faults its pages in again
    _, on_heap_by_default, _ = _probe("default")
    assert not on_heap_by_default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_users_malloc_setting_is_left_alone() -> None:
    applied, on_heap, _ = _probe("keep", MALLOC_TOP_PAD_="131072")
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
