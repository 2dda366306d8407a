"""CPU kernels of cuda_numba against torch references: optimizers over many steps, unscale and
overflow flag, grad norm, bit-exact casts, argument errors and the disk cache."""

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_numba as cn
from cuda_numba import cpu

LOW = (torch.float16, torch.bfloat16)
SIZES = (0, 1, 7, 1023, 100_003)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    cn.warm_up()


def _run_adam(n, gdtype, adamw, steps=20, bias_correction=True, inv_scale=1.0, out_dtype=None,
              lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    ours, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    out = torch.empty(n, dtype=out_dtype) if out_dtype else None
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) / inv_scale).to(gdtype)
        if bias_correction:
            ref.grad = g.float() * inv_scale
            opt.step()
        cn.adam_step(ours, g, m, v, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     step=step, adamw=adamw, bias_correction=bias_correction,
                     inv_scale=inv_scale, model_out=out)
        if out is not None:
            assert torch.equal(out.view(torch.int16), ours.to(out_dtype).view(torch.int16))
    return ours, ref.detach(), m, opt


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdtype", [torch.float32, *LOW])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_matches_torch(n, gdtype, adamw):
    ours, ref, _, _ = _run_adam(n, gdtype, adamw, out_dtype=torch.bfloat16 if adamw else
                                torch.float16)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_adam_reference_is_sensitive():
    # The comparison above must be able to fail: a different weight decay is caught.
    ours, _, _, _ = _run_adam(1023, torch.float32, True, weight_decay=0.1)
    _, ref, _, _ = _run_adam(1023, torch.float32, True, weight_decay=0.2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 3000), lr=st.floats(1e-5, 1e-1), b1=st.floats(0.0, 0.99),
       b2=st.floats(0.5, 0.9999), eps=st.floats(1e-10, 1e-3), wd=st.floats(0.0, 0.5),
       adamw=st.booleans(), inv_scale=st.sampled_from([1.0, 0.5, 2.0 ** -10]),
       gdtype=st.sampled_from([torch.float32, *LOW]), seed=st.integers(0, 2 ** 16))
def test_adam_hypothesis(n, lr, b1, b2, eps, wd, adamw, inv_scale, gdtype, seed):
    ours, ref, _, _ = _run_adam(n, gdtype, adamw, steps=5, inv_scale=inv_scale, lr=lr,
                                betas=(b1, b2), eps=eps, weight_decay=wd, seed=seed)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_adam_without_bias_correction():
    n, lr, b1, b2, eps = 1023, 1e-2, 0.9, 0.999, 1e-8
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen)
    ref, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    rm, rv = torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        cn.adam_step(p, g, m, v, lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, step=step,
                     bias_correction=False)
        rm.mul_(b1).add_(g, alpha=1 - b1)
        rv.mul_(b2).addcmul_(g, g, value=1 - b2)
        ref.addcdiv_(rm, rv.sqrt().add_(eps), value=-lr)
    torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)


def _lion_ref(p, m, g, lr, b1, b2, wd):
    p.mul_(1 - lr * wd)
    p.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-lr)
    m.mul_(b2).add_(g, alpha=1 - b2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdtype", [torch.float32, *LOW])
def test_lion_matches_reference(n, gdtype):
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen)
    ref, m, rm = p.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for _ in range(10):
        g = torch.randn(n, generator=gen).to(gdtype)
        cn.lion_step(p, g, m, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, model_out=out)
        _lion_ref(ref, rm, g.float(), 1e-3, 0.9, 0.99, 0.1)
        assert torch.equal(out.view(torch.int16), p.bfloat16().view(torch.int16))
    torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [
    (0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.01), (0.9, 0.1, False, 0.0),
    (0.9, 0.0, True, 0.05)])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_sgd_matches_torch(n, momentum, dampening, nesterov, wd, gdtype):
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.SGD([ref], lr=0.05, momentum=momentum, dampening=dampening,
                          nesterov=nesterov, weight_decay=wd, foreach=False)
    buf = torch.zeros(n)
    for step in range(10):
        g = torch.randn(n, generator=gen).to(gdtype)
        ref.grad = g.float()
        opt.step()
        cn.sgd_step(p, g, buf, lr=0.05, momentum=momentum, dampening=dampening,
                    weight_decay=wd, nesterov=nesterov, first_step=step == 0)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gdtype", [torch.float32, *LOW])
@pytest.mark.parametrize("n", [1, 7, 1023, 100_003])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_flags_exactly_when_bad(gdtype, n, bad):
    g = torch.randn(n).to(gdtype)
    out = torch.empty(n)
    assert cn.unscale_and_check(g, out, 0.25) is False
    torch.testing.assert_close(out, g.float() * 0.25, rtol=0, atol=0)
    for at in {0, n // 2, n - 1}:
        gb = g.clone()
        gb[at] = bad
        assert cn.unscale_and_check(gb, out, 0.25) is True, at
    assert cn.unscale_and_check(torch.empty(0, dtype=gdtype), torch.empty(0), 2.0) is False


@pytest.mark.parametrize("n", [1, 7, 1023, 1024, 100_003])
def test_unscale_in_place_matches_torch_amp(n):
    """out is grad (the in-place kernel): torch's _amp_foreach_non_finite_check_and_unscale_
    gives the same values and the same flag."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1000
    ref, found = g.clone(), torch.zeros(1)
    assert cn.unscale_and_check(g, g, 1 / 3) is False
    torch._amp_foreach_non_finite_check_and_unscale_([ref], found, torch.full((1,), 1 / 3))
    assert found.item() == 0.0
    torch.testing.assert_close(g, ref, rtol=0, atol=0)
    g[n - 1] = math.nan
    assert cn.unscale_and_check(g, g, 1.0) is True


def test_unscale_large_finite_values_are_not_flagged():
    g = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0])
    assert cn.unscale_and_check(g, torch.empty(3), 1.0) is False
    h = torch.tensor([65504.0, -65504.0], dtype=torch.float16)
    assert cn.unscale_and_check(h, torch.empty(2), 1.0) is False


def test_l2_norm_mixed_dtypes():
    gen = torch.Generator().manual_seed(4)
    ts = [torch.randn(n, generator=gen).to(d) for n, d in
          [(0, torch.float32), (1, torch.float16), (7, torch.bfloat16), (100_003, torch.float32),
           (40_000, torch.bfloat16), (1023, torch.float16)]]
    ref = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in ts]))
    got = cn.l2_norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)
    assert cn.l2_norm([]).item() == 0.0
    assert math.isinf(cn.l2_norm([torch.tensor([1.0, math.inf])]).item())
    assert math.isnan(cn.l2_norm([torch.tensor([1.0, math.nan])]).item())


def test_l2_norm_fp16_float32_partials_stay_close():
    # fp16 squares are summed in float32 chunks (exact squares, rounded sums): over several
    # blocks and a range from subnormals to 65504 the norm stays within 1e-6 of float64's
    gen = torch.Generator().manual_seed(6)
    n = 3 * cpu.BLOCK + 1001
    mags = torch.pow(10.0, torch.empty(n).uniform_(-7.5, 4.8, generator=gen))
    h = (mags * torch.randn(n, generator=gen).sign()).clamp(-65504, 65504).half()
    ref = torch.linalg.vector_norm(h.double())
    torch.testing.assert_close(cn.l2_norm([h]).double(), ref, rtol=1e-6, atol=0)
    # squares of one size, where float32 rounding piles up fastest: short chunks keep the
    # error near 4e-8; one float32 sum per block would be several times 1e-7
    flat = (torch.rand(8 * cpu.BLOCK, generator=gen) + 1).half()
    torch.testing.assert_close(cn.l2_norm([flat]).double(),
                               torch.linalg.vector_norm(flat.double()), rtol=1e-7, atol=0)
    big = torch.full((5000,), 65504.0, dtype=torch.float16)  # largest square, no overflow
    assert cn.l2_norm([big]).item() == pytest.approx(65504.0 * 5000 ** 0.5, rel=1e-6)
    for bad in (math.inf, math.nan):
        h2 = h.clone()
        h2[2 * cpu.BLOCK + 300] = bad
        assert not math.isfinite(cn.l2_norm([h2]).item())


def _special_f32():
    rng = np.random.default_rng(5)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                         0x7F800001, 1, 0x80000001, 0x387FE000, 0x38800000, 0x33800000,
                         0x33000000, 0x33000001, 0x477FE000, 0x477FF000, 0x477FEFFF,
                         0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F800001], np.uint32)
    # ties at the bf16 and fp16 rounding positions, and random bit patterns
    ties = ((rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32) & 0xFFFF0000)
            | 0x8000)
    ties16 = ((rng.integers(0x33000000, 0x47800000, 5000, dtype=np.uint64).astype(np.uint32)
               & 0xFFFFE000) | 0x1000)
    rand = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    return torch.from_numpy(np.concatenate([specials, ties, ties16, rand]).view(np.float32))


def _bits(t):
    return t.view(torch.int16) if t.dtype in LOW else t.view(torch.int32)


@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("dst_dtype", [torch.float32, *LOW])
def test_cast_bit_exact(src_dtype, dst_dtype):
    x = _special_f32()
    if src_dtype in LOW:  # every 16-bit pattern, NaNs and subnormals included
        src = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(src_dtype)
    else:
        src = x
    dst = torch.empty(src.numel(), dtype=dst_dtype)
    cn.cast_(dst, src)
    ref = src.to(dst_dtype)
    if src_dtype == dst_dtype:
        assert torch.equal(_bits(dst), _bits(src))
    else:
        same = _bits(dst) == _bits(ref)
        if dst_dtype == torch.bfloat16:
            # torch's own bf16 NaN bits depend on its code path (0xFFFF from float, 0x7FC0
            # from half); any NaN is right there, every other value must match bit for bit
            nan = torch.isnan(src)
            assert torch.isnan(dst[nan]).all()
            same |= nan
        assert same.all(), np.nonzero((~same).numpy())[0][:5]


def test_flatten_unflatten_roundtrip():
    ts = [torch.randn(3, 4), torch.randn(0), torch.randn(5).bfloat16(), torch.randn(2, 2, 2)]
    flat = cn.flatten(ts)
    assert flat.shape == (12 + 0 + 5 + 8,) and flat.dtype == torch.float32
    torch.testing.assert_close(flat[12:17], ts[2].float())
    half = cn.flatten(ts, out=torch.empty(25, dtype=torch.bfloat16))
    assert torch.equal(half.view(torch.int16),
                       torch.cat([t.flatten().bfloat16() for t in ts]).view(torch.int16))
    views = cn.unflatten(flat, ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    views[0][0, 0] = 42.0
    assert flat[0] == 42.0  # views, not copies
    back = [torch.empty_like(t) for t in ts]
    cn.unflatten_into(flat, back)
    assert back[0][0, 0] == 42.0
    torch.testing.assert_close(back[3], ts[3])


# ---------------------------------------------------------------- errors

def _adam_args(n=8, **over):
    a = dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
             exp_avg_sq=torch.zeros(n))
    a.update(over)
    return a


HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)


@pytest.mark.parametrize("over,match", [
    (dict(exp_avg=torch.zeros(8, 2)[:, 0]), "adam_step: exp_avg must be contiguous"),
    (dict(grad=torch.zeros(8, dtype=torch.float64)),
     "adam_step: grad has dtype torch.float64; expected float32, float16 or bfloat16"),
    (dict(exp_avg=torch.zeros(8, device="meta")),
     "adam_step: exp_avg is on meta but param is on cpu"),
    (dict(exp_avg_sq=torch.zeros(9)), "adam_step: exp_avg_sq has 9 elements but param has 8"),
    (dict(param=torch.zeros(8, dtype=torch.bfloat16)), "adam_step: param has dtype torch.bfloat16"),
    (dict(param=torch.zeros(8, device="meta")), "adam_step: param is on meta"),
])
def test_adam_errors_name_the_argument(over, match):
    with pytest.raises((TypeError, ValueError), match=match):
        cn.adam_step(**_adam_args(**over), **HP)


def test_other_errors_name_the_argument():
    with pytest.raises(TypeError, match="adam_step: model_out has dtype torch.float32"):
        cn.adam_step(**_adam_args(), **HP, model_out=torch.zeros(8))
    with pytest.raises(ValueError, match="unscale_and_check: out has 4 elements but grad has 3"):
        cn.unscale_and_check(torch.zeros(3), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match=r"l2_norm: tensors\[1\] must be contiguous"):
        cn.l2_norm([torch.zeros(3), torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="cast_: dst is on meta but src is on cpu"):
        cn.cast_(torch.zeros(3, device="meta"), torch.zeros(3))
    with pytest.raises(ValueError, match="sgd_step: momentum_buf is None"):
        cn.sgd_step(torch.zeros(3), torch.zeros(3), None, lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="lion_step: grad has dtype torch.int64"):
        cn.lion_step(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.zeros(3), lr=0.1)


# ---------------------------------------------------------------- cache and status

def test_bits_hash_recorded_in_cpu():
    # An edit to _bits.py must change cpu.py too, or numba's cache serves stale kernels.
    src = Path(cpu.__file__).with_name("_bits.py").read_bytes()
    assert cpu.BITS_SHA256 == hashlib.sha256(src).hexdigest()[:16], (
        "update BITS_SHA256 in cuda_numba/cpu.py to the first 16 hex digits of "
        "sha256(_bits.py)")


def test_second_process_loads_from_disk_cache():
    code = ("import cuda_numba as cn; from cuda_numba import cpu; cn.warm_up();"
            "print(sum(sum(k.stats.cache_misses.values()) for b in cpu.KERNELS.values() "
            "for k in b), sum(sum(k.stats.cache_hits.values()) for b in cpu.KERNELS.values() "
            "for k in b))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"}
    for _ in range(2):  # the first run may fill the cache; the second must only read it
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=300)
        assert res.returncode == 0, res.stderr
    misses, hits = map(int, res.stdout.split())
    assert misses == 0 and hits > 0, res.stdout


def test_kernel_status_lists_every_kernel():
    rows = cn.kernel_status()
    assert {r["kernel"] for r in rows} == set(cpu.KERNELS)
    assert all(r["cpu"].startswith("ok") for r in rows), rows
    assert all(isinstance(r["cuda"], str) and r["cuda"] for r in rows)


def test_fp16_widening_is_exact_for_every_bit_pattern() -> None:
    """The CPU kernels' fp16 load (LLVM's fpext where the host has the instruction, the
    bit-twiddling select otherwise) gives _bits.f16_to_f32's bits for all 65,536 patterns:
    subnormals, infinities, NaNs quieted with their payload kept."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = torch.empty(65536, dtype=torch.float32)
    cn.cast_(out, patterns)
    expected = np.array([cpu._f16_to_f32(np.uint16(h)) for h in range(65536)],
                        dtype=np.float32)
    assert np.array_equal(out.numpy().view(np.uint32), expected.view(np.uint32))
    # and the unscale kernel, which is what reads fp16 gradients
    scaled = torch.empty(65536, dtype=torch.float32)
    bad = cn.unscale_and_check(patterns, scaled, 1.0)
    assert bad  # the patterns hold infinities and NaNs
    assert np.array_equal(scaled.numpy().view(np.uint32), expected.view(np.uint32))


def test_fp16_narrowing_matches_the_software_rounding_and_torch() -> None:
    """The CPU kernels' fp16 store (LLVM's fptrunc where the host has the instruction) gives
    _bits.f32_to_f16's bits and torch's: round to nearest even at every exponent, through
    subnormals and overflow to inf, NaNs quieted with their payload truncated. Checked on the
    fp16 rounding boundaries of every exponent, the specials and a million random patterns."""
    rng = np.random.default_rng(7)
    random = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    # each fp32 exponent with the mantissa at, just below and just above a half-way point of
    # fp16 (13 dropped bits), and the specials
    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    near = np.array([0x0FFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001, 0x7FFFFF, 0], np.uint32)
    edges = (exponents[:, None] | near[None, :]).ravel()
    bits = np.concatenate([random, edges, edges | np.uint32(0x80000000),
                           np.array([0x7F800001, 0xFFC12345, 0x7FFFFFFF], np.uint32)])
    x = torch.from_numpy(bits.view(np.float32).copy())
    out = torch.empty(x.numel(), dtype=torch.float16)
    cn.cast_(out, x)  # the cast kernel's store, the one the optimizers' model copy uses
    got = out.view(torch.int16).numpy().view(np.uint16)
    soft = np.array([cpu._f32_to_f16_soft(np.float32(v)) for v in x.numpy()[-6000:]],
                    dtype=np.uint16)
    assert np.array_equal(got[-6000:], soft)
    assert np.array_equal(got, x.half().view(torch.int16).numpy().view(np.uint16))
