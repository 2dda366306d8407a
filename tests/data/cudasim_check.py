"""Run every cuda_numba.cuda kernel under the CUDA simulator and compare with torch CPU.

Run as ``NUMBA_ENABLE_CUDASIM=1 python tests/data/cudasim_check.py``
(tests/cuda_numba/test_kernels_cuda_sim.py does so in a subprocess, so the simulator never leaks
into other tests). Prints progress, then one line ``CUDASIM_RESULT {json}`` with {"checks": {name:
{"ok": bool, "detail": str}}, ...}. Arrays are tiny (1, 7, 300 elements): the simulator runs each
CUDA thread as a Python thread.
"""

import json
import os
import sys
import time
import traceback

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("cudasim_check.py must run with NUMBA_ENABLE_CUDASIM=1 set in the environment")

import warnings  # noqa: E402

import numpy as np  # noqa: E402

# simulated kernels do inf - inf on numpy scalars on purpose (the finite test), in threads
warnings.filterwarnings("ignore", category=RuntimeWarning)
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from cuda_numba import cuda as K  # noqa: E402

assert K._SIM, "cuda_numba.cuda did not pick up the simulator"

T0 = time.time()
DT = {1: torch.float16, 2: torch.bfloat16}
SIZES = (1, 7, 300)
ONLY = set(sys.argv[1:])
CHECKS = {}


def check(name):
    def deco(fn):
        if ONLY and name not in ONLY:
            return fn
        t0 = time.time()
        try:
            detail = fn() or ""
            CHECKS[name] = {"ok": True, "detail": detail}
        except Exception as e:  # report, keep going
            CHECKS[name] = {"ok": False,
                            "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"}
        CHECKS[name]["seconds"] = round(time.time() - t0, 2)
        print(f"{'ok  ' if CHECKS[name]['ok'] else 'FAIL'} {name} ({CHECKS[name]['seconds']}s)",
              flush=True)
        if not CHECKS[name]["ok"]:
            print("     " + CHECKS[name]["detail"].splitlines()[0], flush=True)
        return fn
    return deco


# ------------------------------------------------------------------ helpers

def to_arr(t, kind):
    """torch CPU tensor -> numpy array as the contract carries it (float32 or uint16 bits)."""
    if kind == 0:
        return t.float().contiguous().numpy().copy()
    return t.to(DT[kind]).contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def from_arr(a, kind):
    """numpy array (float32 or uint16 bits of kind) -> float32 torch tensor."""
    if kind == 0:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).clone()
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(DT[kind]).float()


def bits(t, kind):
    """torch float tensor -> uint16 bits of t.to(kind) (torch's rounding)."""
    return t.to(DT[kind]).contiguous().view(torch.int16).numpy().view(np.uint16)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def empty_out():
    return cuda.device_array(0, np.float32)


def assert_close(name, got, want, rtol, atol):
    got = torch.as_tensor(np.asarray(got)).double()
    want = torch.as_tensor(np.asarray(want)).double()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        diff = (got - want).abs()
        excess = torch.nan_to_num(diff - (atol + rtol * want.abs()), nan=float("inf"))
        i = int(excess.argmax())
        raise AssertionError(f"{name}: max |diff| {diff.max().item():.3g} at {i}: "
                             f"got {got[i].item()!r} want {want[i].item()!r}")
    return float((got - want).abs().max()) if got.numel() else 0.0


def assert_bits(name, got, want):
    got = np.asarray(got).astype(np.uint16)
    want = np.asarray(want).astype(np.uint16)
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{name}: {bad.size} of {got.size} bit patterns differ; first at "
                             f"{i}: got 0x{int(got[i]):04x} want 0x{int(want[i]):04x}")


def make_grad(n, kind, seed, scale=1.0):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if kind:
        g = g.to(DT[kind]).float()  # exactly representable in the grad dtype
    return g


# ------------------------------------------------------------------ cast

def special_f32():
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65505.0, 65519.99, 65520.0, 65536.0, 1e30, -1e30,
            float("inf"), float("-inf"), float("nan"), -float("nan"),
            6.0e-8, 5.960464477539063e-08, 2.9802322387695312e-08, 2.99e-08, 2.98e-08,
            1e-10, 6.103515625e-05, 6.1e-05, 3.4028235e38, 1.1754944e-38, 1e-45,
            3.14159, 1.0009765625, 1.00048828125, 1.00146484375, 1.00390625, 1.001953125,
            1.005859375]
    t = torch.tensor(vals, dtype=torch.float32)
    raw = np.array([0x7F800001, 0xFFC12345, 0x7FA00000, 0x3F808000, 0x3F818000, 0x3F807FFF,
                    0x3F800001, 0x33000000, 0x33000001, 0x387FE000, 0x387FF000, 0x38800000,
                    0x477FEFFF, 0x477FF000, 0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x80018000],
                   dtype=np.uint32)
    r = torch.from_numpy(raw.view(np.int32)).view(torch.float32)
    rnd = torch.from_numpy(np.random.default_rng(1).integers(0, 2**32, 200, dtype=np.uint64)
                           .astype(np.uint32).view(np.int32)).view(torch.float32)
    ties = torch.randn(60, generator=torch.Generator().manual_seed(3))
    tb = ties.view(torch.int32)
    ties16 = ((tb & ~0x1FFF) | 0x1000).view(torch.float32)   # fp16 halfway points
    tiesbf = ((tb & ~0xFFFF) | 0x8000).view(torch.float32)   # bf16 halfway points
    small = torch.randn(40, generator=torch.Generator().manual_seed(4)) * 1e-6  # fp16 subnormals
    return torch.cat([t, r, rnd, ties16, tiesbf, small])


@check("cast_f32_to_f16_bf16")
def _():
    x = special_f32()
    src = dev(x.numpy())
    for k in (1, 2):
        out = cuda.device_array(x.numel(), np.uint16)
        K.cast(src, 0, out, k)
        got, want = out.copy_to_host(), bits(x, k)
        nan = torch.isnan(x).numpy()
        assert_bits(f"f32->{DT[k]}", got[~nan], want[~nan])
        # NaN: fp16 keeps sign and top payload bits, quiet; bf16 is 0xFFFF (torch CPU's
        # vectorised conversion; its scalar path writes 0x7FC0, CUDA's 0x7FFF)
        xb = x.view(torch.int32).numpy().view(np.uint32)[nan]
        rule = (((xb >> 16) & 0x8000) | 0x7E00 | ((xb >> 13) & 0x3FF)) if k == 1 else \
            np.full(xb.shape, 0xFFFF)
        assert_bits(f"f32->{DT[k]} NaN", got[nan], rule)
    return f"{x.numel()} values incl. NaN payloads, inf, ties, subnormals, overflow"


@check("cast_bits_to_f32_and_across")
def _():
    rng = np.random.default_rng(5)
    b = np.concatenate([rng.integers(0, 65536, 300).astype(np.uint16),
                        np.array([0, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00,
                                  0x7E00, 0x7C01, 0xFE55, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF,
                                  0x0080, 0x007F, 0x8001], dtype=np.uint16)])
    for k in (1, 2):
        src = dev(b)
        out = cuda.device_array(b.size, np.float32)
        K.cast(src, k, out, 0)
        want = from_arr(b, k)
        got = out.copy_to_host()
        wb, gb = want.numpy().view(np.uint32), got.view(np.uint32)
        nan = np.isnan(want.numpy())
        if not np.array_equal(np.isnan(got), nan) or not np.array_equal(gb[~nan], wb[~nan]):
            i = int(np.nonzero((gb != wb) & ~nan)[0][0]) if (gb != wb)[~nan].any() else -1
            raise AssertionError(f"{DT[k]}->f32 differs at {i}")
        # NaN: comes out quiet with sign and payload kept (as x86/CUDA hardware converts);
        # torch's own CPU result depends on the element's position (vector body vs scalar
        # tail), so only NaN-ness is compared with torch, and the rule with itself here.
        if k == 1:
            hb = b[nan].astype(np.uint32)
            rule = ((hb & 0x8000) << 16) | 0x7F800000 | (((hb & 0x3FF) | 0x200) << 13)
        else:
            rule = b[nan].astype(np.uint32) << 16
            rule = rule | 0x00400000
        if not np.array_equal(gb[nan] | (0 if k == 1 else 0x00400000), rule):
            raise AssertionError(f"{DT[k]}->f32: NaN bits not sign|quiet|payload")
        other = 3 - k
        out2 = cuda.device_array(b.size, np.uint16)
        K.cast(src, k, out2, other)
        assert_bits(f"{DT[k]}->{DT[other]}", out2.copy_to_host(), bits(want, other))
        out3 = cuda.device_array(b.size, np.uint16)
        K.cast(src, k, out3, k)
        assert_bits(f"{DT[k]} copy", out3.copy_to_host(), b)
    return f"{b.size} bit patterns each way"


# ------------------------------------------------------------------ adam / adamw

def run_adam(n, grad_kind, out_kind, decoupled, wd, inv_scale, steps=5, lr=1e-2,
             betas=(0.9, 0.999), eps=1e-8, seed=0):
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(seed + 100))
    ref_p = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref_p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    p, m, v = dev(p0.numpy()), dev(np.zeros(n, np.float32)), dev(np.zeros(n, np.float32))
    mo = cuda.device_array(n, np.uint16) if out_kind else empty_out()
    worst = 0.0
    for step in range(1, steps + 1):
        g = make_grad(n, grad_kind, seed + step, scale=1.0 / inv_scale)  # "scaled" grads
        ref_p.grad = g.clone() * inv_scale
        opt.step()
        K.adam(p, dev(to_arr(g, grad_kind)), grad_kind, m, v, mo, out_kind, lr, betas[0],
               betas[1], eps, wd, 1 - betas[0] ** step, 1 - betas[1] ** step, inv_scale,
               decoupled)
    st = opt.state[ref_p]
    got_p = p.copy_to_host()
    worst = max(worst, assert_close("param", got_p, ref_p.detach(), 1e-5, 1e-6))
    assert_close("exp_avg", m.copy_to_host(), st["exp_avg"], 1e-5, 1e-7)
    assert_close("exp_avg_sq", v.copy_to_host(), st["exp_avg_sq"], 1e-5, 1e-9)
    ulps = 0
    if out_kind:
        mob = mo.copy_to_host()
        # bit-exact: the model copy is torch's rounding of the master param we computed
        assert_bits("model_out", mob, bits(torch.from_numpy(got_p), out_kind))
        # and within one ulp of torch's rounding of torch's own param
        refb = bits(ref_p.detach(), out_kind).astype(np.int32)
        ulps = int(np.abs(mob.astype(np.int32) - refb).max())
        if ulps > 1:
            raise AssertionError(f"model_out is {ulps} ulps from torch's param.to()")
    return worst, ulps


def adam_check(decoupled):
    cases = [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 0), (2, 0)]
    if not decoupled:  # the L2 path differs in one line: a smaller matrix keeps the run short
        cases = [(0, 0), (1, 1), (2, 2)]
    worst, ulps, count = 0.0, 0, 0
    for n in SIZES:
        for gk, ok in cases:
            for wd in (0.0, 0.01):
                for inv in ((1.0,) if gk == 2 else (1.0, 1.0 / 1024)):
                    if n == 300 and (wd == 0.0 or inv != 1.0) and (gk, ok) not in ((1, 1), (2, 2)):
                        continue  # the simulator is slow: full matrix on the small sizes only
                    try:
                        w, u = run_adam(n, gk, ok, decoupled, wd, inv, seed=n + 10 * gk)
                    except AssertionError as e:
                        raise AssertionError(f"n={n} grad_kind={gk} out_kind={ok} wd={wd} "
                                             f"inv_scale={inv}: {e}") from None
                    worst, ulps, count = max(worst, w), max(ulps, u), count + 1
    return (f"{count} configs x 5 steps; max |param diff| {worst:.3g}; "
            f"model_out max ulp vs torch {ulps}")


@check("adamw_vs_torch")
def _():
    return adam_check(True)


@check("adam_l2_vs_torch")
def _():
    return adam_check(False)


@check("adam_grid_stride_one_block")
def _():
    saved = K._max_blocks
    K._max_blocks = 1  # 1 block of 256 threads over 300 elements: the stride loop runs twice
    try:
        w, u = run_adam(300, 2, 2, True, 0.01, 1.0, steps=2)
    finally:
        K._max_blocks = saved
    return f"max |param diff| {w:.3g}"


@check("adam_inv_scale_non_power_of_two")
def _():
    w, u = run_adam(7, 0, 1, True, 0.1, 0.3, steps=3, lr=1e-3)
    return f"max |param diff| {w:.3g}"


# ------------------------------------------------------------------ unscale + check

@check("unscale_check")
def _():
    count = 0
    for k in (0, 1, 2):
        for n in SIZES:
            g = make_grad(n, k, 7 + n) * 64
            for bad_at, bad_val in [(None, None), (0, float("inf")), (n - 1, float("nan")),
                                    (n // 2, float("-inf")), (n - 1, float("inf"))]:
                if n == 300 and bad_at == n // 2 and k:
                    continue
                gg = g.clone()
                if bad_at is not None:
                    gg[bad_at] = bad_val
                out = cuda.device_array(n, np.float32)
                flag = dev(np.zeros(1, np.int32))
                inv = 1.0 / 64
                K.unscale_check(dev(to_arr(gg, k)), k, out, inv, flag)
                f = int(flag.copy_to_host()[0])
                want_flag = 0 if bad_at is None else 1
                if f != want_flag:
                    raise AssertionError(f"kind={k} n={n} bad_at={bad_at}: flag {f} != {want_flag}")
                want = from_arr(to_arr(gg, k), k) * inv
                got = out.copy_to_host()
                wb, gb = want.numpy().view(np.uint32), got.view(np.uint32)
                nan = np.isnan(want.numpy())
                if not (np.array_equal(np.isnan(got), nan) and np.array_equal(gb[~nan], wb[~nan])):
                    raise AssertionError(f"kind={k} n={n}: unscaled values differ from torch")
                count += 1
    # a flag already raised by an earlier bucket is never cleared
    flag = dev(np.ones(1, np.int32))
    K.unscale_check(dev(np.ones(5, np.float32)), 0, cuda.device_array(5, np.float32), 1.0, flag)
    if int(flag.copy_to_host()[0]) != 1:
        raise AssertionError("a finite bucket cleared the flag")
    return f"{count} cases, bit-exact output, inf/NaN at first/middle/last positions"


# ------------------------------------------------------------------ sum of squares

@check("sum_squares")
def _():
    worst = 0.0
    cases = [(0, 1), (0, 300), (1, 7), (2, 300)]
    for k, n in cases:
        g = make_grad(n, k, 11 + n, scale=3.0)
        nb = K.sum_squares_blocks(n)
        part = cuda.device_array(nb, np.float64)
        K.sum_squares(dev(to_arr(g, k)), k, part)
        got = float(part.copy_to_host().sum())
        want = float((from_arr(to_arr(g, k), k).double() ** 2).sum())
        rel = abs(got - want) / max(want, 1e-300)
        if rel > 1e-12:
            raise AssertionError(f"kind={k} n={n}: {got!r} vs torch {want!r} (rel {rel:.3g})")
        worst = max(worst, rel)
    saved = K._max_blocks
    K._max_blocks = 1
    try:
        g = make_grad(300, 0, 99)
        part = cuda.device_array(K.sum_squares_blocks(300), np.float64)
        if part.shape[0] != 1:
            raise AssertionError("sum_squares_blocks ignores the block cap")
        K.sum_squares(dev(g.numpy()), 0, part)
        got = float(part.copy_to_host().sum())
        want = float((g.double() ** 2).sum())
        if abs(got - want) > 1e-12 * want:
            raise AssertionError(f"one block, grid-stride: {got!r} vs {want!r}")
    finally:
        K._max_blocks = saved
    if K.sum_squares_blocks(0) != 0:
        raise AssertionError("sum_squares_blocks(0) != 0")
    return f"max rel err {worst:.3g} (float64 partials)"


# ------------------------------------------------------------------ lion

@check("lion_vs_reference")
def _():
    count = 0
    for n in SIZES:
        for gk, ok in ((0, 0), (1, 1), (2, 2), (0, 2)):
            lr, b1, b2, wd, inv = 1e-3, 0.9, 0.99, 0.1, (1.0 if gk == 2 else 0.5)
            p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
            rp, rm = p0.clone(), torch.zeros(n)
            p, m = dev(p0.numpy()), dev(np.zeros(n, np.float32))
            mo = cuda.device_array(n, np.uint16) if ok else empty_out()
            for step in range(1, 6):
                g = make_grad(n, gk, 50 + step + n)
                if step == 1 and n > 1:
                    g[0] = 0.0  # c == 0: sign 0, no update
                gf = g * inv
                c = rm * b1 + gf * (1 - b1)
                rp = rp * (1 - lr * wd)
                rp = rp - lr * torch.sign(c)
                rm = rm * b2 + gf * (1 - b2)
                K.lion(p, dev(to_arr(g, gk)), gk, m, mo, ok, lr, b1, b2, wd, inv)
            got = p.copy_to_host()
            try:
                assert_close("param", got, rp, 0, 1e-7)
                assert_close("exp_avg", m.copy_to_host(), rm, 1e-6, 1e-8)
                if ok:
                    assert_bits("model_out", mo.copy_to_host(), bits(torch.from_numpy(got), ok))
            except AssertionError as e:
                raise AssertionError(f"n={n} grad_kind={gk} out_kind={ok}: {e}") from None
            count += 1
    return f"{count} configs x 5 steps"


# ------------------------------------------------------------------ sgd

@check("sgd_vs_torch")
def _():
    count = 0
    configs = [dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0),
               dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.01),
               dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01),
               dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.01)]
    for n in SIZES:
        for ci, cfg in enumerate(configs):
            for gk, ok in ((0, 0), (1, 1), (2, 2)):
                if n == 300 and gk != ci % 3:
                    continue
                lr, inv = 0.05, (0.25 if gk != 2 else 1.0)
                p0 = torch.randn(n, generator=torch.Generator().manual_seed(n + ci))
                rp = torch.nn.Parameter(p0.clone())
                opt = torch.optim.SGD([rp], lr=lr, foreach=False, **cfg)
                p = dev(p0.numpy())
                buf = dev(np.zeros(n, np.float32)) if cfg["momentum"] else empty_out()
                mo = cuda.device_array(n, np.uint16) if ok else empty_out()
                for step in range(1, 6):
                    g = make_grad(n, gk, 70 + step + n, scale=1 / inv)
                    rp.grad = g * inv
                    opt.step()
                    K.sgd(p, dev(to_arr(g, gk)), gk, buf, mo, ok, lr, cfg["momentum"],
                          cfg["dampening"], cfg["weight_decay"], cfg["nesterov"], step == 1, inv)
                got = p.copy_to_host()
                try:
                    # grads are ~4: one float32 ulp of an input is ~5e-7 absolute
                    assert_close("param", got, rp.detach(), 1e-6, 2e-6)
                    if cfg["momentum"]:
                        assert_close("momentum_buffer", buf.copy_to_host(),
                                     opt.state[rp]["momentum_buffer"], 1e-6, 2e-6)
                    if ok:
                        assert_bits("model_out", mo.copy_to_host(), bits(torch.from_numpy(got), ok))
                except AssertionError as e:
                    raise AssertionError(f"n={n} cfg={cfg} grad_kind={gk}: {e}") from None
                count += 1
    return f"{count} configs x 5 steps"


# ------------------------------------------------------------------ flat runs

@check("flat_run_of_params_in_one_call")
def _():
    """What cuda_numba.optim hands the kernels for a run of parameters laid out flat: views at
    an offset inside larger buffers (bucket, master weights, state, model copy). One adam call
    over the run equals torch AdamW per parameter; the elements around the run stay untouched;
    the bucket's unscale and sum of squares over the same view match torch."""
    shapes, lead, tail = [(5,), (3, 4), (1,), (9,)], 3, 4
    run = sum(int(np.prod(s)) for s in shapes)
    total = lead + run + tail
    p0 = torch.randn(total, generator=torch.Generator().manual_seed(3))
    ref = [torch.nn.Parameter(t.clone().view(s)) for t, s in
           zip(p0[lead:lead + run].split([int(np.prod(s)) for s in shapes]), shapes)]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    p, m, v = dev(p0.numpy()), dev(np.zeros(total, np.float32)), dev(np.zeros(total, np.float32))
    mo = dev(np.full(total, 0x1234, np.uint16))
    bucket_kind = 2
    for step in range(1, 4):
        g = make_grad(total, bucket_kind, 40 + step, scale=8.0)
        bucket = dev(to_arr(g, bucket_kind))
        master_grad = cuda.device_array(total, np.float32)
        flag = dev(np.zeros(1, np.int32))
        K.unscale_check(bucket[lead:lead + run], bucket_kind, master_grad[lead:lead + run],
                        0.125, flag)
        if int(flag.copy_to_host()[0]) != 0:
            raise AssertionError("a finite bucket raised the overflow flag")
        want = g[lead:lead + run] * 0.125
        assert_close("unscaled run", master_grad.copy_to_host()[lead:lead + run], want, 0, 0)
        part = cuda.device_array(K.sum_squares_blocks(run), np.float64)
        K.sum_squares(bucket[lead:lead + run], bucket_kind, part)
        sq = float(part.copy_to_host().sum())
        if abs(sq - float((g[lead:lead + run].double() ** 2).sum())) > 1e-9 * sq:
            raise AssertionError(f"sum of squares over the run: {sq!r}")
        for r, gr in zip(ref, want.split([r.numel() for r in ref])):
            r.grad = gr.view(r.shape).clone()
        opt.step()
        K.adam(p[lead:lead + run], master_grad[lead:lead + run], 0, m[lead:lead + run],
               v[lead:lead + run], mo[lead:lead + run], 2, 1e-2, 0.9, 0.999, 1e-8, 0.1,
               1 - 0.9 ** step, 1 - 0.999 ** step, 1.0, True)
    got = p.copy_to_host()
    want_p = torch.cat([r.detach().reshape(-1) for r in ref])
    worst = assert_close("run params", got[lead:lead + run], want_p, 1e-5, 1e-6)
    assert_close("exp_avg", m.copy_to_host()[lead:lead + run],
                 torch.cat([opt.state[r]["exp_avg"].reshape(-1) for r in ref]), 1e-5, 1e-7)
    assert_bits("model copy", mo.copy_to_host()[lead:lead + run],
                bits(torch.from_numpy(got[lead:lead + run].copy()), 2))
    untouched = np.concatenate([np.arange(lead), np.arange(lead + run, total)])
    if not (np.array_equal(got[untouched], p0.numpy()[untouched])
            and np.all(mo.copy_to_host()[untouched] == 0x1234)
            and not m.copy_to_host()[untouched].any()):
        raise AssertionError("the kernels wrote outside the run's view")
    return f"{len(shapes)} params, {run} elements at offset {lead}; max |diff| {worst:.3g}"


# ------------------------------------------------------------------ edge cases

@check("size_zero_and_argument_checks")
def _():
    z32 = cuda.device_array(0, np.float32)
    z16 = cuda.device_array(0, np.uint16)
    flag = dev(np.zeros(1, np.int32))
    K.adam(z32, z16, 1, z32, z32, z16, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 1.0, True)
    K.lion(z32, z32, 0, z32, z32, 0, 1e-3, 0.9, 0.99, 0.0, 1.0)
    K.sgd(z32, z32, 0, z32, z32, 0, 0.1, 0.9, 0.0, 0.0, False, True, 1.0)
    K.unscale_check(z16, 2, z32, 1.0, flag)
    K.sum_squares(z32, 0, cuda.device_array(0, np.float64))
    K.cast(z32, 0, z16, 1)
    if int(flag.copy_to_host()[0]) != 0:
        raise AssertionError("size 0 touched the flag")
    bad = 0
    for call in (lambda: K.cast(dev(np.zeros(3, np.float32)), 1,
                                cuda.device_array(3, np.uint16), 2),
                 lambda: K.adam(dev(np.zeros(3, np.float32)), dev(np.zeros(2, np.float32)), 0,
                                dev(np.zeros(3, np.float32)), dev(np.zeros(3, np.float32)), z32,
                                0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 1.0, True),
                 lambda: K.sum_squares(dev(np.zeros(3, np.float32)), 0,
                                       cuda.device_array(5, np.float64))):
        try:
            call()
        except (TypeError, ValueError):
            bad += 1
    if bad != 3:
        raise AssertionError(f"only {bad} of 3 malformed calls were refused")
    return "size 0 launches nothing; wrong dtype/length/partial size refused"


if __name__ == "__main__":
    result = {"checks": CHECKS, "seconds": round(time.time() - T0, 2),
              "numba_sim": True}
    print("CUDASIM_RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if all(c["ok"] for c in CHECKS.values()) else 1)
