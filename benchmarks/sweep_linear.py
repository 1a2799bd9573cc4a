"""One-call GPU sweep of the token GEMMs of Stable Diffusion's transformer blocks: fastdiff's linear kernel on each
of its tiles, its TMA form on each tile, and cuBLAS with the epilogue in torch (the engine's three candidates), at
the shapes of one guided SD 1.5 512x512 step (U-Net batch 2), fp16, with the fused epilogue each op has (bias,
GEGLU, residual). Each is timed as CUDA-graph replays (``fastdiff.engine.tuning.time_call_us``), checked against
``linear_ref`` and reported in TFLOP/s and % of the measured matmul ceiling; the summary weighs each shape by how
often a step runs it.

    PYTHONPATH=src python benchmarks/sweep_linear.py --out sweep-linear.json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdiff.atomic import write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.engine.tuning import time_call_us
from fastdiff.kernels.cost_model import linear_cost
from fastdiff.kernels.linear import linear, linear_ref, linear_tiles, pack_linear_weight, tma_linear_unsupported
from fastdiff.models.stable_diffusion import SD_PRESETS

log = logging.getLogger("benchmarks.sweep_linear")


def sd_cases(preset: str, batch: int, size: int) -> list[dict]:
    """The distinct token GEMMs of one step of ``preset``'s U-Net at ``batch`` rows and ``size`` pixels, with how
    many of each a step runs (``count``): per transformer block proj_in, q|k|v, the attention output + residual,
    the cross-attention query and output + residual, the GEGLU projection, the feed-forward output + residual
    and proj_out + residual."""
    config = SD_PRESETS[preset].unet
    latent = size // 8
    levels = list(zip(config.block_out_channels, config.down_block_types, strict=True))
    blocks = {}  # (channels, tokens) -> transformer blocks per step
    for level, (channels, block) in enumerate(levels):
        if "CrossAttn" in block:
            tokens = (latent >> level) ** 2
            # down: layers_per_block blocks, up: one more (diffusers' up blocks have layers_per_block + 1)
            blocks[(channels, tokens)] = 2 * config.layers_per_block + 1
    deepest = config.block_out_channels[-1]
    blocks[(deepest, (latent >> (len(levels) - 1)) ** 2)] = 1  # the mid block's
    cases = []
    for (c, tokens), count in blocks.items():
        rows = batch * tokens
        for role, k, n, geglu, bias, residual in (
            ("proj_in", c, c, False, True, False), ("to_qkv", c, 3 * c, False, False, False),
            ("attn1.to_out", c, c, False, True, True), ("attn2.to_q", c, c, False, False, False),
            ("attn2.to_out", c, c, False, True, True), ("ff.proj (GEGLU)", c, 4 * c, True, True, False),
            ("ff.out", 4 * c, c, False, True, True), ("proj_out", c, c, False, True, True),
        ):  # fmt: skip
            cases.append(dict(role=role, m=rows, k=k, n=n, geglu=geglu, bias=bias, residual=residual, count=count))
    return cases


def make_inputs(case: dict, device: torch.device) -> tuple[tuple, dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    m, k, n = case["m"], case["k"], case["n"]
    n_w = 2 * n if case["geglu"] else n
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.float16)
    weight = (torch.randn(n_w, k, device=device, generator=gen) / k**0.5).half()
    bias = torch.randn(n_w, device=device, generator=gen).half() if case["bias"] else None
    kwargs = {"geglu": case["geglu"], "packed": True}
    if case["residual"]:
        kwargs["residual"] = torch.randn(m, n, device=device, generator=gen, dtype=torch.float16)
    return (x, pack_linear_weight(weight, case["geglu"]), bias), kwargs


def candidates(args: tuple, kwargs: dict, out: torch.Tensor) -> dict[str, Callable[[], object]]:
    x, weight, bias = args
    calls: dict[str, Callable[[], object]] = {}
    for tile in linear_tiles(x.shape[0]):
        name = "t" + "x".join(map(str, tile))
        calls[f"triton-{name}"] = lambda tile=tile: linear(*args, **kwargs, out=out, tile=tile)
    if tma_linear_unsupported(x, weight) is None:  # the TMA form on its (4-warp) tiles
        for tile in linear_tiles(x.shape[0], tma=True):
            name = "t" + "x".join(map(str, tile))
            calls[f"triton-tma-{name}"] = lambda tile=tile: linear(*args, **kwargs, out=out, tile=tile, tma=True)
    half, residual = out.shape[1], kwargs.get("residual")

    def cublas() -> None:  # as the engine's cublas candidate (engine.calls.linear_call)
        y = torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
        if kwargs["geglu"]:
            y = y[:, :half] * F.gelu(y[:, half:])
        torch.add(y, residual, out=out) if residual is not None else out.copy_(y)

    calls["cublas"] = cublas
    return calls


def is_pointer(name: str) -> bool:
    """A candidate of the pointer (non-TMA) linear kernel: ``triton-t<tile>``."""
    return name.startswith("triton-t") and not name.startswith("triton-tma")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--reps", type=int, default=50, help="calls per timed CUDA graph")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    results = []
    for case in sd_cases("sd15", 2, 512):
        inputs, kwargs = make_inputs(case, device)
        ref = linear_ref(*[a.float() if a is not None else None for a in inputs],
                         **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})  # fmt: skip
        out = torch.empty(case["m"], case["n"], device=device, dtype=torch.float16)
        cost = linear_cost(case["m"], case["n"], case["k"], 2, bias=case["bias"], geglu=case["geglu"],
                           residual=case["residual"])  # fmt: skip
        rows = {}
        for name, call in candidates(inputs, kwargs, out).items():
            call()
            torch.cuda.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
            us = time_call_us(call, args.reps)
            tflops = cost.flops / us / 1e6
            rows[name] = {"us": us, "tflops": tflops, "pct_of_matmul": 100 * tflops / ceilings["tflops"],
                          "rel_err": err}  # fmt: skip
        best = min(rows, key=lambda n: rows[n]["us"])
        best_pointer = min((n for n in rows if is_pointer(n)), key=lambda n: rows[n]["us"])
        times = (rows[best]["us"], rows[best_pointer]["us"], rows["cublas"]["us"])
        log.info("%s m=%d k=%d n=%d: best %s %.1f us (pointer kernel %.1f, cuBLAS %.1f)", case["role"], case["m"],
                 case["k"], case["n"], best, *times)  # fmt: skip
        results.append({**case, "flops": cost.flops, "bytes": cost.bytes, "best": best, "candidates": rows})

    def step_us(pick: Callable[[dict], float]) -> float:
        return sum(r["count"] * pick(r["candidates"]) for r in results)

    summary = {
        "best_of_all_us": step_us(lambda c: min(v["us"] for v in c.values())),
        "best_without_tma_us": step_us(lambda c: min(v["us"] for n, v in c.items() if "tma" not in n)),
        "best_pointer_tile_us": step_us(lambda c: min(v["us"] for n, v in c.items() if is_pointer(n))),
        "cublas_us": step_us(lambda c: c["cublas"]["us"]),
    }
    log.info("one step's token GEMMs: %s", {k: round(v, 1) for k, v in summary.items()})
    out = {"schema": "fastdiff.benchmarks.sweep_linear/1", "env": environment(), "ceilings": ceilings,
           "method": "CUDA-graph replays (time_call_us), median; fp16; per step: each shape times its count",
           "summary": summary, "results": results}  # fmt: skip
    write_text_atomic(args.out, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
