"""One-call GPU sweep for attention, group_norm_act and attention_gate: fp32 accuracy, per-config times.

    PYTHONPATH=src python benchmarks/sweep_attention_gn.py [--quick]

Prints (1) relative errors of the fp32 paths against float64, (2) every attention tile config's time at the
benchmark shapes next to the autotuned wrapper and torch SDPA, (3) group_norm_act designs and parameters
against torch, each timed eagerly (``do_bench``, what benchmarks/kernels.py reports) and as CUDA-graph replays
(GPU time alone), and the host time of one eager call.
"""

# ruff: noqa: B023 - each closure is called only inside the loop iteration that defines it
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

from fastdiff.kernels import attention as attn_mod
from fastdiff.kernels import attention_gate as gate_mod
from fastdiff.kernels import group_norm_act as gn_mod


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median ms per call over replays of a CUDA graph of ``reps`` calls (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per eager call (no sync inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def accuracy() -> None:
    print("== fp32 accuracy (rel err vs float64) ==")
    gen = torch.Generator().manual_seed(1)
    for b, h, lq, lk, d, mult in [(3, 4, 1000, 1000, 32, 1.0), (1, 8, 4096, 4096, 40, 1.0), (1, 1, 24, 70, 16, 20.0)]:
        q, k, v = (torch.randn((b, x, h, d), generator=gen).cuda().transpose(1, 2) for x in (lq, lk, lk))
        q = q * mult
        out = attn_mod.attention(q, k, v)
        ref = attn_mod.attention_ref(q.double(), k.double(), v.double())
        print(f"attention fp32 b{b} h{h} q{lq} k{lk} d{d} x{mult}: {rel(out, ref):.2e}")
    for n, cx, cg, inter, hh, ww in [(5, 33, 17, 70, 7, 9), (3, 256, 256, 128, 8, 8), (2, 320, 96, 160, 9, 7)]:
        x = torch.randn((n, cx, hh, ww), generator=gen).cuda().contiguous(memory_format=torch.channels_last)
        g = torch.randn((n, cg, hh, ww), generator=gen).cuda().contiguous(memory_format=torch.channels_last)
        w_x = (torch.randn((inter, cx, 1, 1), generator=gen) * cx**-0.5).cuda()
        w_g = (torch.randn((inter, cg), generator=gen) * cg**-0.5).cuda()
        w_psi = torch.randn((1, inter, 1, 1), generator=gen).cuda()
        b_x, b_g, b_psi = (torch.randn(s, generator=gen).cuda() for s in (inter, inter, 1))
        out = gate_mod.attention_gate(x, g, w_x, w_g, b_g, w_psi, b_psi, b_x=b_x)
        args = [t.double() for t in (x, g, w_x, w_g, b_g, w_psi, b_psi)]
        ref = gate_mod.attention_gate_ref(*args, b_x=b_x.double())
        print(f"attention_gate fp32 n{n} cx{cx} cg{cg} inter{inter}: {rel(out, ref):.2e}")


def attention_configs(quick: bool) -> None:
    print("== attention fp16: per-config ms (do_bench), autotuned wrapper, SDPA ==")
    cases = {
        "cifar10-b1": (1, 1, 256, 256, 256),
        "cifar10-b256": (256, 1, 256, 256, 256),
        "sd15-b2": (2, 8, 4096, 4096, 40),
        "sd15-b2-cross": (2, 8, 4096, 77, 40),
        "sd15-b2-d80": (2, 8, 1024, 1024, 80),
        "sd15-b2-d160": (2, 8, 256, 256, 160),
    }
    gen = torch.Generator().manual_seed(0)
    for name, (b, h, lq, lk, d) in cases.items():
        q, k, v = (
            torch.randn((b, x, h, d), generator=gen).to("cuda", torch.float16).transpose(1, 2) for x in (lq, lk, lk)
        )
        out = torch.empty((b, h, lq, d), device="cuda", dtype=torch.float16)
        ref = attn_mod.attention_ref(q, k, v)
        block_d = max(16, triton.next_power_of_2(d))
        width = max(64, block_d)
        meta = dict(HEAD_DIM=d, BLOCK_D=block_d, ALIGN=attn_mod._row_alignment(q, k, v, out), DOT_PRECISION="tf32")
        args = (q, k, v, out, d**-0.5 * attn_mod.LOG2_E, h, lq, lk, *q.stride(), *k.stride(), *v.stride(),
                *out.stride(), 1)  # fmt: skip
        flops = 4.0 * b * h * lq * lk * d
        rows = []
        if not quick:
            for bm, bn, w, s in attn_mod.TUNING_CONFIGS[width]:
                if bm > max(16, triton.next_power_of_2(lq)):
                    continue

                def run(bm=bm, bn=bn, w=w, s=s) -> None:
                    attn_mod._attention_kernel[(triton.cdiv(lq, bm), b * h)](
                        *args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s
                    )

                try:
                    ms = bench_ms(run)
                    rows.append((ms, f"{bm}x{bn} w{w} s{s}", rel(out, ref)))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    rows.append((float("inf"), f"{bm}x{bn} w{w} s{s} FAILED {type(exc).__name__}", float("nan")))
            for ms, label, err in sorted(rows):
                print(f"  {name:14s} {label:28s} {ms:.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s err {err:.1e}")

        def triton_call() -> None:
            attn_mod.attention(q, k, v, out=out)

        def sdpa_call() -> None:
            F.scaled_dot_product_attention(q, k, v)

        t_tri, t_sdpa = bench_ms(triton_call), bench_ms(sdpa_call)
        best = attn_mod._TUNED[width].best_config
        print(
            f"{name:14s} triton {t_tri:.4f} ms (graph {graph_ms(triton_call):.4f}, host {host_us(triton_call):.0f} us,"
            f" best {best}) | sdpa {t_sdpa:.4f} ms (graph {graph_ms(sdpa_call):.4f}) | err {rel(out, ref):.1e}"
        )


def group_norm(quick: bool) -> None:
    print("== group_norm_act fp16 (+silu): do_bench ms / graph ms / host us ==")
    cases = {
        "sd15-b2": (2, 320, 32, 64, 64),
        "sd15-b1-640": (1, 640, 32, 32, 32),
        "sd15-b2-1280": (2, 1280, 32, 16, 16),
        "cifar10-b1": (1, 128, 32, 32, 32),
        "cifar10-b256": (256, 128, 32, 32, 32),
    }
    gen = torch.Generator().manual_seed(0)
    for name, (n, c, g, h, w) in cases.items():
        x = torch.randn((n, c, h, w), generator=gen).to("cuda", torch.float16)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = (1 + 0.1 * torch.randn(c, generator=gen)).to("cuda", torch.float16)
        bias = (0.1 * torch.randn(c, generator=gen)).to("cuda", torch.float16)
        out = torch.empty_like(x)
        ref = gn_mod.group_norm_act_ref(x.float(), g, weight.float(), bias.float(), 1e-6, activation="silu")
        plan = gn_mod._plan(n, c, h * w, g, x.device, "auto")

        def torch_call() -> None:
            F.silu(F.group_norm(x, g, weight, bias, 1e-6))

        print(f"{name:14s} torch {bench_ms(torch_call):.4f} / {graph_ms(torch_call):.4f} | auto plan {plan}")
        designs = ["auto", "single_pass", "two_phase"] if not quick else ["auto"]
        for design in designs:

            def call(design=design) -> None:
                gn_mod.group_norm_act(x, g, weight, bias, 1e-6, activation="silu", out=out, design=design)

            t = bench_ms(call)
            print(
                f"  {design:12s} {t:.4f} / {graph_ms(call):.4f} / {host_us(call):.0f} us "
                f"{4 * x.numel() / t / 1e6:.0f} GB/s err {rel(out, ref):.1e}"
            )


def profile_gn() -> None:
    print("== profiler: group_norm_act sd15-b2 two_phase and single_pass kernels ==")
    x = torch.randn((2, 320, 64, 64), device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    weight = torch.ones(320, device="cuda", dtype=torch.float16)
    bias = torch.zeros(320, device="cuda", dtype=torch.float16)
    for design in ("auto", "single_pass"):
        for _ in range(3):
            gn_mod.group_norm_act(x, 32, weight, bias, activation="silu", design=design)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                gn_mod.group_norm_act(x, 32, weight, bias, activation="silu", design=design)
            torch.cuda.synchronize()
        print(design)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="no per-config sweep, auto design only")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: acc,attn,gn,prof")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    sections = (
        ("acc", accuracy),
        ("gn", lambda: group_norm(args.quick)),
        ("prof", profile_gn),
        ("attn", lambda: attention_configs(args.quick)),
    )
    for key, section in sections:
        if key not in skip:
            t0 = time.perf_counter()
            section()
            print(f"[{key} took {time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
