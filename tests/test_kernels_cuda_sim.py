"""cuda_numba.cuda kernels under the numba CUDA simulator, against torch CPU references.

The simulator is switched on by NUMBA_ENABLE_CUDASIM=1, which numba reads once at import, so
the checks run in a subprocess (tests/data/cudasim_check.py) and never leak into other tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "cudasim_check.py"

EXPECTED = [
    "cast_f32_to_f16_bf16",
    "cast_bits_to_f32_and_across",
    "adamw_vs_torch",
    "adam_l2_vs_torch",
    "adam_grid_stride_one_block",
    "adam_inv_scale_non_power_of_two",
    "unscale_check",
    "sum_squares",
    "lion_vs_reference",
    "sgd_vs_torch",
    "size_zero_and_argument_checks",
]

_cache = {}


def _run():
    if "result" not in _cache:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CUDASIM_RESULT ")]
        if not lines:
            pytest.fail(f"cudasim_check.py gave no result (rc {proc.returncode})\n"
                        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
        _cache["result"] = json.loads(lines[-1][len("CUDASIM_RESULT "):])
    return _cache["result"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", EXPECTED)
def test_cuda_kernel_under_simulator(name):
    """One pytest item per check; the simulator subprocess runs once for all of them."""
    checks = _run()["checks"]
    assert name in checks, f"check {name} did not run; ran: {sorted(checks)}"
    assert checks[name]["ok"], f"{name}: {checks[name]['detail']}"


@pytest.mark.timeout(180)
def test_no_unexpected_failures():
    failed = {n: c["detail"] for n, c in _run()["checks"].items() if not c["ok"]}
    assert not failed, "\n".join(f"{n}: {d}" for n, d in failed.items())
