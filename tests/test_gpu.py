"""Checks that need a CUDA GPU: NCCL through flowtrain.comm, the CUDA kernels on real tensors
against torch, and a real engine step. Each is skipped, saying so, where there is no GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import free_port, rank_env

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU on this machine (GPU checks run on a lent device)")
pytestmark = [needs_gpu, pytest.mark.timeout(300)]


def test_nccl_all_reduce_through_comm(tmp_path: Path) -> None:
    script = tmp_path / "nccl.py"
    script.write_text(textwrap.dedent("""
        import anyio, torch
        from flowtrain import comm
        assert comm.init_distributed() == "nccl"
        t = torch.arange(1024, device="cuda", dtype=torch.float32)
        anyio.run(comm.all_reduce_async, t)
        assert torch.equal(t.cpu(), torch.arange(1024, dtype=torch.float32))
        print("NCCL OK")
    """))
    env = rank_env(0, 1, free_port())
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "NCCL OK" in proc.stdout, proc.stderr


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_adam_kernel_matches_torch(grad_dtype: torch.dtype) -> None:
    from cuda_numba import adam_step

    torch.manual_seed(0)
    n = 1_000_003
    param = torch.randn(n, device="cuda")
    ref = param.clone().requires_grad_(True)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    for step in range(1, 6):
        grad = torch.randn(n, device="cuda").to(grad_dtype)
        adam_step(param, grad, exp_avg, exp_avg_sq, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.01, step=step, adamw=True)
        ref.grad = grad.float()
        opt.step()
    torch.cuda.synchronize()
    torch.testing.assert_close(param, ref.detach(), rtol=1e-5, atol=1e-6)


def test_cuda_unscale_check_and_norm_match_torch() -> None:
    from cuda_numba import l2_norm, unscale_and_check

    g = torch.randn(333_333, device="cuda")
    out = torch.empty_like(g)
    assert unscale_and_check(g, out, 0.5) is False
    torch.testing.assert_close(out, g * 0.5)
    g[1234] = float("inf")
    assert unscale_and_check(g, out, 0.5) is True
    h = torch.randn(100_000, device="cuda")
    torch.testing.assert_close(l2_norm([h]).cpu(), torch.linalg.vector_norm(h).cpu(),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("copy_dtype", [None, torch.float16, torch.bfloat16])
def test_cuda_flat_optimizers_step_a_run_in_one_call(copy_dtype: torch.dtype | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters and gradients laid out flat on the GPU (as engine buckets are): FusedAdam,
    FusedSGD and FusedLion step all of them in one CUDA kernel call, with torch's numbers
    (Lion: the per-parameter path's), the half-precision model copy written in the same call."""
    from cuda_numba import optim

    shapes = [(7,), (333, 65), (1,), (0,), (64, 3, 2), (1000,)]
    total = sum(torch.Size(s).numel() for s in shapes)

    def flat_params(seed: int) -> list[torch.nn.Parameter]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        weights = torch.randn(total, device="cuda", generator=gen)
        grads = torch.zeros(total, device="cuda")
        out, off = [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            p = torch.nn.Parameter(weights.narrow(0, off, n).view(s))
            p.grad = grads.narrow(0, off, n).view(s)
            out.append(p)
            off += n
        return out

    calls: list[int] = []
    for name in ("adam_step", "sgd_step", "lion_step"):
        real = getattr(optim.ops, name)
        monkeypatch.setattr(optim.ops, name, lambda p, *a, _real=real, **k: (
            calls.append(p.numel()), _real(p, *a, **k))[1])
    cases = [(lambda ps: optim.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
             (lambda ps: optim.FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True),
              lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                         foreach=False))]
    for make_ours, make_ref in cases:
        ours, ref = flat_params(0), [torch.nn.Parameter(p.detach().clone())
                                     for p in flat_params(0)]
        opt, ropt = make_ours(ours), make_ref(ref)
        copies = torch.zeros(total, device="cuda", dtype=copy_dtype or torch.float32)
        if copy_dtype is not None:
            views = [copies.narrow(0, o, p.numel()).view(p.shape) for o, p in
                     zip(torch.tensor([0] + [p.numel() for p in ours]).cumsum(0).tolist(), ours)]
            opt.write_model_copies(zip(ours, views))
        calls.clear()
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            for a, b in zip(ours, ref):
                g = torch.randn(a.shape, device="cuda", generator=gen)
                a.grad.copy_(g)
                b.grad = g.clone()
            opt.step()
            ropt.step()
        torch.cuda.synchronize()
        assert calls == [total] * 4
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if copy_dtype is not None:
            flat_weights = torch.cat([p.detach().reshape(-1) for p in ours])
            torch.testing.assert_close(copies, flat_weights.to(copy_dtype), rtol=0, atol=0)
    flat, loose = flat_params(2), [torch.nn.Parameter(p.detach().clone().contiguous())
                                   for p in flat_params(2)]
    for params in (flat, loose):
        for p in params:
            p.grad = torch.ones_like(p)
        optim.FusedLion(params, lr=1e-3, weight_decay=0.1).step()
    for a, b in zip(flat, loose):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_engine_half_precision_on_the_gpu(tmp_path: Path, precision: str) -> None:
    """fp16/bf16 through the engine on the GPU: the master gradients unscaled and checked by
    the CUDA kernel in one pass per bucket, one FusedAdam call per bucket, and the losses
    tracking fp32's."""
    script = tmp_path / "half.py"
    script.write_text(textwrap.dedent(f"""
        import torch, flowtrain
        from cuda_numba import optim

        def run(precision):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                        torch.nn.Linear(256, 1)).cuda()
            cfg = {{"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 1.0,
                   "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}}
            if precision != "fp32":
                cfg[precision] = {{"enabled": True}}
            if precision == "fp16":
                cfg["fp16"]["initial_scale_power"] = 8
            engine, *_ = flowtrain.initialize(model=model, config=cfg,
                                              model_parameters=model.parameters())
            calls, real = [], optim.ops.adam_step
            optim.ops.adam_step = lambda p, *a, **k: (calls.append(p.numel()), real(p, *a, **k))
            g = torch.Generator(device="cuda").manual_seed(1)
            losses = []
            for _ in range(12):
                x = torch.randn(32, 64, device="cuda", generator=g)
                y = torch.randn(32, 1, device="cuda", generator=g)
                dtype = next(engine.module.parameters()).dtype
                loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
                engine.backward(loss); engine.step()
                losses.append(loss.item())
            optim.ops.adam_step = real
            steps = 12 - engine.skipped_steps
            assert calls == [b.numel for b in engine.plan.buckets] * steps, calls
            engine.destroy()
            return losses

        base, half = run("fp32"), run("{precision}")
        for a, b in zip(half, base):
            assert abs(a - b) <= 0.05 * max(1.0, abs(b)), (half, base)
        print("GPU HALF OK")
    """))
    env = rank_env(0, 1, free_port())
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0 and "GPU HALF OK" in proc.stdout, proc.stderr[-4000:]


def test_engine_trains_on_the_gpu(tmp_path: Path) -> None:
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent("""
        import torch, flowtrain
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 1)).cuda()
        ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 1)).cuda()
        ref.load_state_dict(model.state_dict())
        cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
        for _ in range(10):
            x = torch.randn(32, 64, device="cuda"); y = torch.randn(32, 1, device="cuda")
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss); engine.step()
            rl = torch.nn.functional.mse_loss(ref(x), y)
            ropt.zero_grad(); rl.backward(); ropt.step()
            assert abs(loss.item() - rl.item()) < 1e-4, (loss.item(), rl.item())
        print("GPU STEP OK", loss.item())
    """))
    env = rank_env(0, 1, free_port())
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0 and "GPU STEP OK" in proc.stdout, proc.stderr[-4000:]


def test_zero_cpu_offload_on_the_gpu(tmp_path: Path) -> None:
    """ZeRO-Offload with the model on the GPU: master shards and Adam state live in pinned CPU
    memory, the step runs on the CPU shard by shard, and the losses equal stage 0's."""
    script = tmp_path / "offload.py"
    script.write_text(textwrap.dedent("""
        import torch, flowtrain

        def run(zero, precision):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                        torch.nn.Linear(256, 1)).cuda()
            cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2,
                   "gradient_clipping": 1.0, "zero_optimization": zero,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
            if precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                              config=cfg)
            g = torch.Generator(device="cuda").manual_seed(1)
            losses = []
            for _ in range(16):
                x = torch.randn(32, 64, device="cuda", generator=g)
                y = torch.randn(32, 1, device="cuda", generator=g)
                dtype = next(engine.module.parameters()).dtype
                loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
                engine.backward(loss); engine.step()
                losses.append(loss.item())
            if engine.zero is not None and engine.zero.offloader is not None:
                m = engine.zero.master[0]
                assert m.device.type == "cpu", m.device
                state = engine.optimizer.state[m]
                assert all(v.device.type == "cpu" for v in state.values() if torch.is_tensor(v))
                assert next(engine.module.parameters()).device.type == "cuda"
            engine.destroy()
            return losses

        for precision, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
            base = run({"stage": 0}, precision)
            for zero in ({"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}}):
                got = run(zero, precision)
                for a, b in zip(got, base):
                    assert abs(a - b) <= tol * max(1.0, abs(b)), (precision, zero, got, base)
        print("GPU OFFLOAD OK")
    """))
    env = rank_env(0, 1, free_port())
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0 and "GPU OFFLOAD OK" in proc.stdout, proc.stderr[-4000:]
