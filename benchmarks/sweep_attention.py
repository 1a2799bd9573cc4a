"""One-call GPU sweep of attention at Stable Diffusion's shapes: PyTorch's SDPA with each of its backends forced
(flash, memory-efficient, cuDNN) and with its own choice, against fastdiff's Triton attention on each of its tiles,
every one on the engine's layout (self attention: q, k, v as strided views of the fused q|k|v GEMM's output; cross
attention: q dense, k and v views of the per-prompt K|V projection), timed as CUDA-graph replays
(``fastdiff.engine.tuning.time_call_us``), checked against ``attention_ref`` and reported in TFLOP/s and % of the
measured matmul ceiling (the flash-attention count: 4 B H Lq Lk D FLOPs).

    PYTHONPATH=src python benchmarks/sweep_attention.py --out sweep-attention.json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastdiff.atomic import write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.engine.tuning import time_call_us
from fastdiff.kernels.attention import attention, attention_ref, attention_tiles
from fastdiff.kernels.cost_model import attention_cost
from fastdiff.models.stable_diffusion import SD_PRESETS

log = logging.getLogger("benchmarks.sweep_attention")
BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
TEXT_TOKENS = 77


def sd_cases(preset: str, batch: int, size: int) -> list[dict]:
    """The distinct attention shapes of ``preset``'s U-Net at ``batch`` rows (2 per guided prompt) and ``size``
    pixels: one self and one cross attention per level with transformer blocks."""
    config = SD_PRESETS[preset].unet
    latent = size // 8
    cases = []
    heads_per_level = config.per_level("attention_head_dim")
    levels = zip(config.block_out_channels, config.down_block_types, heads_per_level, strict=True)
    for level, (channels, block, heads) in enumerate(levels):
        if "CrossAttn" not in block:
            continue
        tokens = (latent >> level) ** 2  # (diffusers' attention_head_dim counts the heads: channels // heads each)
        for cross in (False, True):
            cases.append(dict(model=preset, batch=batch, heads=heads, head_dim=channels // heads, q_len=tokens,
                              kv_len=TEXT_TOKENS if cross else tokens, cross=cross))  # fmt: skip
    return cases


def engine_layout(case: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v and the output as the engine hands them to attention (``engine.calls.attention_call``)."""
    b, h, d, lq, lk = case["batch"], case["heads"], case["head_dim"], case["q_len"], case["kv_len"]
    gen = torch.Generator(device=device).manual_seed(0)
    if case["cross"]:
        q = torch.randn(b, lq, h, d, device=device, generator=gen, dtype=torch.float16).transpose(1, 2)
        kv = torch.randn(b, lk, 2, h, d, device=device, generator=gen, dtype=torch.float16)
    else:
        qkv = torch.randn(b, lq, 3, h, d, device=device, generator=gen, dtype=torch.float16)
        q, kv = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1:]
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    out = torch.empty(b, lq, h, d, device=device, dtype=torch.float16).transpose(1, 2)
    return q, k, v, out


def candidates(q, k, v, out) -> dict[str, Callable[[], object]]:
    calls: dict[str, Callable[[], object]] = {"sdpa": lambda: out.copy_(F.scaled_dot_product_attention(q, k, v))}
    for name, backend in BACKENDS.items():

        def forced(backend: SDPBackend = backend) -> None:
            with sdpa_kernel([backend]):
                out.copy_(F.scaled_dot_product_attention(q, k, v))

        calls[name] = forced
    for tile in attention_tiles(q.shape[-1], q.shape[2]):
        calls["triton-t" + "x".join(map(str, tile))] = lambda tile=tile: attention(q, k, v, out=out, tile=tile)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--reps", type=int, default=50, help="calls per timed CUDA graph")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    results = []
    for case in sd_cases("sd15", 2, 512) + sd_cases("sd21", 2, 768):
        q, k, v, out = engine_layout(case, device)
        ref = attention_ref(q.float(), k.float(), v.float())
        cost = attention_cost(case["batch"], case["heads"], case["q_len"], case["kv_len"], case["head_dim"])
        rows = {}
        for name, call in candidates(q, k, v, out).items():
            try:
                call()
                torch.cuda.synchronize()
                err = float((out.float() - ref).abs().max())
                us = time_call_us(call, args.reps)
            except Exception as exc:  # a backend that does not take this shape is a row with its reason
                rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                continue
            tflops = cost.flops / us / 1e6
            rows[name] = {"us": us, "tflops": tflops, "pct_of_matmul": 100 * tflops / ceilings["tflops"],
                          "max_abs_err": err}  # fmt: skip
        timed = {n: r for n, r in rows.items() if "us" in r}
        best = min(timed, key=lambda n: timed[n]["us"])
        log.info("%s %s: best %s %.1f us; sdpa %.1f us", case["model"], case, best, timed[best]["us"],
                 timed.get("sdpa", {}).get("us", float("nan")))  # fmt: skip
        results.append({**case, "flops": cost.flops, "best": best, "candidates": rows})
    out = {"schema": "fastdiff.benchmarks.sweep_attention/1", "env": environment(), "ceilings": ceilings,
           "method": "CUDA-graph replays (time_call_us), median; the engine's strided q/k/v views; fp16",
           "results": results}  # fmt: skip
    write_text_atomic(args.out, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
