"""flowtrain's numba CUDA kernels vs torch's own CUDA kernels, on real CUDA tensors.

    python benchmarks/gpu_kernels.py            # 10M, 100M and (memory allowing) 1B params
    python benchmarks/gpu_kernels.py --quick    # 10M only, fewer repeats
    python benchmarks/gpu_kernels.py --sizes 1e6,5e7 --reps 30 --json out.json

For each size: fused AdamW step (fp32 master, fp32 grads) by cuda_numba.cuda.adam against
torch.optim.AdamW(fused=True) and (foreach=True), alternating the three step by step, timed
with CUDA events, median reported; achieved GB/s counts 28 B/param (read p, g, m, v; write p,
m, v) against a measured device-to-device copy bandwidth. Correctness: max |diff| of the params
after 10 identical steps. Then unscale + inf/NaN check (vs torch._amp_foreach_non_finite_check_
and_unscale_, 8 B/elem) and the gradient L2 norm (vs torch.linalg.vector_norm, 4 B/elem).
Also our AdamW with bf16 grads and a bf16 model copy written in the same pass (no torch twin).

With no GPU it prints one line saying so and exits 0.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10M params only, fewer repeats")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated parameter counts (default 1e7,1e8,1e9)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per kernel")
    ap.add_argument("--steps", type=int, default=10, help="steps for the correctness check")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args()


def no_gpu(reason):
    print(f"gpu_kernels: no CUDA GPU present ({reason}); nothing to benchmark, skipping.")
    sys.exit(0)


def main():
    args = parse_args()
    try:
        import torch
    except ImportError:
        no_gpu("torch is not installed")
    if not torch.cuda.is_available():
        no_gpu("torch.cuda.is_available() is False")
    from numba import cuda
    if not cuda.is_available():
        no_gpu("numba.cuda.is_available() is False")
    from cuda_numba import cuda as K

    torch.cuda.init()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
          f"{props.multi_processor_count} SMs; torch {torch.__version__}")
    if args.sizes:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    elif args.quick:
        sizes = [10_000_000]
    else:
        sizes = [10_000_000, 100_000_000, 1_000_000_000]
    reps = args.reps or (10 if args.quick else 25)

    def stream():
        return cuda.external_stream(torch.cuda.current_stream().cuda_stream)

    def arr(t):
        # float32 / int32 / float64 tensor -> numba device array over the same memory
        return cuda.as_cuda_array(t, sync=False)

    def u16(t):
        # fp16/bf16 tensor -> uint16 device array over the same memory
        a = cuda.as_cuda_array(t.view(torch.int16), sync=False)
        return a.view("uint16")

    def timed(fn):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3  # seconds

    results = {"device": props.name, "sizes": {}}

    for n in sizes:
        free, _ = torch.cuda.mem_get_info()
        need = 80 * n  # 3 optimizers x 16 B + grads, foreach temporaries, copies
        if need > 0.9 * free:
            print(f"\n== {n:,} params: skipped, needs ~{need / 2**30:.0f} GiB, "
                  f"{free / 2**30:.0f} GiB free")
            results["sizes"][str(n)] = {"skipped": "not enough memory"}
            continue
        print(f"\n== {n:,} params")
        row = {}
        gen = torch.Generator(device=dev).manual_seed(0)
        p0 = torch.randn(n, device=dev, generator=gen)
        g0 = torch.randn(n, device=dev, generator=gen)
        lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01

        # ---- copy bandwidth reference
        dst = torch.empty_like(p0)
        dst.copy_(p0)
        t_copy = statistics.median(timed(lambda dst=dst, p0=p0: dst.copy_(p0))
                                   for _ in range(reps))
        copy_gbs = 2 * 4 * n / t_copy / 1e9
        del dst
        print(f"  device copy: {copy_gbs:8.1f} GB/s (read+write)")
        row["copy_GBps"] = copy_gbs

        # ---- AdamW: ours, torch fused, torch foreach
        ours = {"p": p0.clone(), "m": torch.zeros_like(p0), "v": torch.zeros_like(p0), "step": 0}
        a_p, a_g = arr(ours["p"]), arr(g0)
        a_m, a_v = arr(ours["m"]), arr(ours["v"])
        no_out = cuda.as_cuda_array(torch.empty(0, device=dev), sync=False)

        def ours_step(grad_arr=a_g, grad_kind=0, out=no_out, out_kind=0, st=ours, p=a_p,
                      m=a_m, v=a_v, lr=lr, betas=betas, eps=eps, wd=wd):
            st["step"] += 1
            k = st["step"]
            K.adam(p, grad_arr, grad_kind, m, v, out, out_kind, lr, betas[0], betas[1], eps,
                   wd, 1 - betas[0] ** k, 1 - betas[1] ** k, 1.0, True, stream=stream())

        torch_opts = {}
        for name, kw in (("torch_fused", {"fused": True}), ("torch_foreach", {"foreach": True})):
            prm = torch.nn.Parameter(p0.clone())
            prm.grad = g0.clone()
            torch_opts[name] = (prm, torch.optim.AdamW([prm], lr=lr, betas=betas, eps=eps,
                                                       weight_decay=wd, **kw))

        t0 = time.time()
        ours_step()  # first call: JIT compile (or load from the on-disk cache)
        torch.cuda.synchronize()
        row["adam_first_call_s"] = time.time() - t0
        for _, opt in torch_opts.values():
            opt.step()
        for _ in range(args.steps - 1):
            ours_step()
            for _, opt in torch_opts.values():
                opt.step()
        torch.cuda.synchronize()
        diffs = {name: (ours["p"] - prm.detach()).abs().max().item()
                 for name, (prm, _) in torch_opts.items()}
        fd = (torch_opts["torch_fused"][0].detach()
              - torch_opts["torch_foreach"][0].detach()).abs().max().item()
        print(f"  adamw correctness after {args.steps} steps: max|ours - fused| "
              f"{diffs['torch_fused']:.3g}, max|ours - foreach| {diffs['torch_foreach']:.3g} "
              f"(fused vs foreach {fd:.3g}); first call {row['adam_first_call_s']:.2f}s")
        row["adam_maxdiff"] = diffs
        row["adam_maxdiff_fused_vs_foreach"] = fd

        times = {"ours": [], "torch_fused": [], "torch_foreach": []}
        for _ in range(reps):
            times["ours"].append(timed(ours_step))
            for name, (_, opt) in torch_opts.items():
                times[name].append(timed(opt.step))
        row["adam"] = {}
        for name, ts in times.items():
            t = statistics.median(ts)
            gbs = 28 * n / t / 1e9
            row["adam"][name] = {"ms": t * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs}
            print(f"  adamw {name:14s} {t * 1e3:9.3f} ms  {gbs:8.1f} GB/s  "
                  f"({100 * gbs / copy_gbs:5.1f}% of copy)")
        del torch_opts

        # ---- ours with bf16 grads and bf16 model copy in the same pass (28 B/param too)
        g_bf = g0.to(torch.bfloat16)
        out_bf = torch.empty(n, device=dev, dtype=torch.bfloat16)
        a_gbf, a_obf = u16(g_bf), u16(out_bf)
        ours_step(a_gbf, 2, a_obf, 2)
        torch.cuda.synchronize()
        exact = bool(torch.equal(out_bf.view(torch.int16),
                                 ours["p"].to(torch.bfloat16).view(torch.int16)))
        t = statistics.median(timed(lambda a_gbf=a_gbf, a_obf=a_obf: ours_step(a_gbf, 2, a_obf, 2))
                              for _ in range(reps))
        gbs = 28 * n / t / 1e9
        row["adam_bf16_grad_bf16_out"] = {"ms": t * 1e3, "GBps": gbs, "model_out_exact": exact}
        print(f"  adamw ours bf16 g + bf16 out {t * 1e3:9.3f} ms  {gbs:8.1f} GB/s  "
              f"(model copy == param.to(bf16): {exact})")
        del g_bf, out_bf, a_gbf, a_obf, ours, a_p, a_m, a_v

        # ---- unscale + inf/NaN check
        inv = 1.0 / 1024
        g_scaled = g0 * 1024
        out = torch.empty_like(g0)
        flag = torch.zeros(1, device=dev, dtype=torch.int32)
        a_gs, a_out, a_flag = arr(g_scaled), arr(out), arr(flag)
        K.unscale_check(a_gs, 0, a_out, inv, a_flag, stream=stream())
        torch.cuda.synchronize()
        ok_vals = bool(torch.equal(out, g_scaled * inv))
        ok_flag0 = int(flag.item()) == 0
        g_bad = g_scaled.clone()
        g_bad[n // 2] = float("inf")
        flag.zero_()
        K.unscale_check(arr(g_bad), 0, a_out, inv, a_flag, stream=stream())
        ok_flag1 = int(flag.item()) == 1
        del g_bad
        found = torch.zeros(1, device=dev)
        inv_t = torch.full((1,), inv, device=dev)
        tg = g_scaled.clone()
        t_ours, t_torch = [], []
        for _ in range(reps):
            t_ours.append(timed(
                lambda a_gs=a_gs, a_out=a_out, inv=inv, a_flag=a_flag: K.unscale_check(
                    a_gs, 0, a_out, inv, a_flag, stream=stream())))
            t_torch.append(timed(
                lambda tg=tg, found=found, inv_t=inv_t:
                torch._amp_foreach_non_finite_check_and_unscale_([tg], found, inv_t)))
        row["unscale"] = {"correct": ok_vals and ok_flag0 and ok_flag1}
        for name, ts in (("ours", t_ours), ("torch_amp", t_torch)):
            t = statistics.median(ts)
            gbs = 8 * n / t / 1e9
            row["unscale"][name] = {"ms": t * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs}
            print(f"  unscale {name:12s} {t * 1e3:9.3f} ms  {gbs:8.1f} GB/s  "
                  f"({100 * gbs / copy_gbs:5.1f}% of copy)")
        print(f"  unscale correctness: values bit-exact {ok_vals}, flag clean {ok_flag0}, "
              f"flag on inf {ok_flag1}")
        del g_scaled, out, tg

        # ---- gradient L2 norm
        nb = K.sum_squares_blocks(n)
        partial = torch.empty(nb, device=dev, dtype=torch.float64)
        a_part = arr(partial)

        def ours_norm(a_g=a_g, a_part=a_part, partial=partial):
            K.sum_squares(a_g, 0, a_part, stream=stream())
            return partial.sum().sqrt()

        got = ours_norm().item()
        ref = torch.linalg.vector_norm(g0.double()).item()
        ref32 = torch.linalg.vector_norm(g0).item()
        rel = abs(got - ref) / ref
        t_ours = [timed(ours_norm) for _ in range(reps)]
        t_torch = [timed(lambda g0=g0: torch.linalg.vector_norm(g0)) for _ in range(reps)]
        row["norm"] = {"rel_err_vs_fp64": rel, "torch_fp32_rel_err": abs(ref32 - ref) / ref}
        for name, ts in (("ours", t_ours), ("torch", t_torch)):
            t = statistics.median(ts)
            gbs = 4 * n / t / 1e9
            row["norm"][name] = {"ms": t * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs}
            print(f"  grad norm {name:10s} {t * 1e3:9.3f} ms  {gbs:8.1f} GB/s  "
                  f"({100 * gbs / copy_gbs:5.1f}% of copy)")
        print(f"  grad norm correctness: rel err vs fp64 {rel:.3g} "
              f"(torch fp32 norm: {row['norm']['torch_fp32_rel_err']:.3g}); {nb} partials")
        results["sizes"][str(n)] = row
        del p0, g0, partial
        torch.cuda.empty_cache()

    ok = all(
        r.get("skipped") or (r["adam_maxdiff"]["torch_fused"] < 1e-4 and r["unscale"]["correct"]
                             and r["norm"]["rel_err_vs_fp64"] < 1e-6
                             and r["adam_bf16_grad_bf16_out"]["model_out_exact"])
        for r in results["sizes"].values())
    results["all_correct"] = ok
    print(f"\nall correctness checks passed: {ok}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
