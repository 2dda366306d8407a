"""The CPU kernels leave torch's thread count alone: numba's OpenMP pool shares torch's libgomp,
and starting it used to raise torch to NUMBA_NUM_THREADS threads per rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, cuda_numba
before = torch.get_num_threads()
cuda_numba.warm_up(("adam",))
p, g = torch.zeros(100_000), torch.ones(100_000)
m, v = torch.zeros(100_000), torch.zeros(100_000)
cuda_numba.adam_step(p, g, m, v, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)
print(before, torch.get_num_threads())
"""


@pytest.mark.timeout(150)
def test_warm_up_and_steps_keep_torchs_thread_count() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NUMBA_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1"]
