"""cuda_numba.cuda kernels under the numba CUDA simulator, against torch CPU references.

The simulator is switched on by NUMBA_ENABLE_CUDASIM=1, which numba reads once at import, so
the checks run in a subprocess (tests/data/cudasim_check.py) and never leak into other tests.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = REPO
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
    "flat_run_of_params_in_one_call",
]

_cache = {}
SIM_TIMEOUT_S = 300


def _run():
    if "result" not in _cache:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
        # the simulator interprets every thread in Python, so the checks take minutes: they
        # get SIM_TIMEOUT_S rather than the suite's default
        proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CUDASIM_RESULT ")]
        if not lines:
            pytest.fail(f"cudasim_check.py gave no result (rc {proc.returncode})\n"
                        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
        _cache["result"] = json.loads(lines[-1][len("CUDASIM_RESULT "):])
    return _cache["result"]


@pytest.mark.timeout(SIM_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", EXPECTED)
def test_cuda_kernel_under_simulator(name):
    """One pytest item per check; the simulator subprocess runs once for all of them."""
    checks = _run()["checks"]
    assert name in checks, f"check {name} did not run; ran: {sorted(checks)}"
    assert checks[name]["ok"], f"{name}: {checks[name]['detail']}"


@pytest.mark.timeout(SIM_TIMEOUT_S + 60)
def test_no_unexpected_failures():
    failed = {n: c["detail"] for n, c in _run()["checks"].items() if not c["ok"]}
    assert not failed, "\n".join(f"{n}: {d}" for n, d in failed.items())


# The real-GPU code path (libdevice bitcasts, no simulator) compiled to PTX for sm_90, where
# numba finds libNVVM; needs no GPU. numba asks the driver for the current device's compute
# capability when it compiles device functions, so the subprocess answers that itself.
_PTX_SCRIPT = r'''
import types as _t
import numba.cuda.dispatcher as D
from numba import cuda, types as T
D.get_current_device = lambda: _t.SimpleNamespace(compute_capability=(9, 0))
from cuda_numba import cuda as K
assert not K._SIM
f, u, i64, b, f64, F = T.float32[::1], T.uint16[::1], T.int64, T.boolean, T.float64[::1], T.float32
sigs = {
    "_adam_kernel": [(f, g, i64, f, f, o, i64) + (F,) * 11 + (b, i64)
                     for g in (f, u) for o in (f, u)],
    "_lion_kernel": [(f, g, i64, f, o, i64) + (F,) * 7 + (i64,) for g in (f, u) for o in (f, u)],
    "_sgd_kernel": [(f, g, i64, f, o, i64, F, F, F, F, b, b, F, i64)
                    for g in (f, u) for o in (f, u)],
    "_unscale_kernel": [(g, i64, f, F, T.int32[::1], i64) for g in (f, u)],
    "_sum_squares_kernel": [(g, i64, f64, i64) for g in (f, u)],
    "_cast_kernel": [(s, i64, d, i64, i64) for s in (f, u) for d in (f, u)],
}
for name, ss in sigs.items():
    for sig in ss:
        ptx, _ = cuda.compile_ptx(getattr(K, name).py_func, sig, cc=(9, 0))
        if name != "_sum_squares_kernel" and ".f64" in ptx:
            raise SystemExit(f"{name}{sig}: float64 arithmetic in an fp32 kernel")
print("PTX_OK")
'''


@pytest.mark.timeout(SIM_TIMEOUT_S + 60)
def test_cuda_kernels_compile_to_ptx():
    probe = subprocess.run([sys.executable, "-c",
                            "from numba.cuda.cudadrv import nvvm; print(nvvm.is_available())"],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    if probe.stdout.strip() != "True":
        pytest.skip("numba finds no libNVVM here: cannot compile the real CUDA path to PTX")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=170)
    assert "PTX_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
