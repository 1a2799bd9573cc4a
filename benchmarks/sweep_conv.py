"""One-call GPU sweep of the conv implementations at a model's own conv shapes: the gather kernel
(``kernels.conv2d``; where its grid leaves SMs idle also split-K, ``triton-k<split>``), the TMA kernel
(``kernels.conv2d_tma``) in each tile config and its default, and cuDNN; with ``--fp8`` also the TMA kernel on
e4m3 operands (its ``rel_err`` is then e4m3's own, a few percent); with ``--gather-tiles`` also the gather kernel in
each of ``GATHER_TILES`` (``conv2d(..., tiles=)``), unsplit and at each split, where its own plan is the latency one
(the grid of 128x128 tiles leaves SMs idle): the sweep behind that plan.

    PYTHONPATH=src python benchmarks/sweep_conv.py --model ddpm-cifar10 --batch 1,256 --out sweep.json
    PYTHONPATH=src python benchmarks/sweep_conv.py --batch 1 --gather-tiles --only up_blocks.2 --out tiles.json

For every distinct conv of the engine's lowering (shape, kernel, stride, padding, upsampling, epilogue flags; a
channel slice of a concat buffer when the engine's input is one), each implementation is timed as CUDA-graph
replays (GPU time alone, launch overhead excluded: what the engine's autotune compares) and checked against
``conv2d_ref`` in float64. Rows carry TFLOP/s and % of the bf16 matmul ceiling measured in the same run, and
the GPU, library versions and git sha. ``--budget-s`` stops the sweep (writing what it has) before the GPU
call's time limit.
"""

# ruff: noqa: B023 - each closure is called only inside the loop iteration that defines it
from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdiff.atomic import write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.tuning import time_call_us
from fastdiff.kernels.common import SplitWorkspace, activation_ref
from fastdiff.kernels.conv2d import (
    GemmTiles,
    conv2d,
    conv2d_cost,
    conv2d_ref,
    pack_conv_weight,
    split_k_choices,
    unpack_conv_weight,
)
from fastdiff.kernels.conv2d_tma import (
    TmaConfig,
    conv2d_tma,
    pack_conv_weight_fp8,
    pack_upsample2_weight,
    tma_conv_unsupported,
)
from fastdiff.kernels.fp8 import E4M3_MAX, quantize_e4m3_ref
from fastdiff.models import load_unet

log = logging.getLogger("benchmarks.sweep_conv")

TMA_CONFIGS = [
    TmaConfig(128, 128, 64, 8, 3),
    TmaConfig(128, 128, 64, 8, 4),
    TmaConfig(128, 128, 64, 4, 4),
    TmaConfig(128, 256, 64, 8, 3),
    TmaConfig(64, 128, 64, 4, 4),
    TmaConfig(64, 64, 64, 4, 4),
    TmaConfig(256, 128, 64, 8, 3),
    TmaConfig(128, 128, 64, 4, 3),
    TmaConfig(128, 128, 64, 4, 2),
    TmaConfig(128, 128, 128, 4, 3),
    TmaConfig(128, 128, 128, 8, 3),
]
"""Tile configs tried on the convs with enough 128x128 tiles to fill the GPU twice over. The 4-warp 128x128 tiles
take 115, 82 and 49 KB of shared memory at 4, 3 and 2 stages (255 registers a thread; Triton 3.9 for sm_90a), and
128-deep steps halve the steps per tile (as the fp8 kernel's do). On the H100 (``sweep-conv-stages-*`` results)
3 stages tied with 4, 2 stages and 128-deep steps lost (1.4x and 1.1-1.4x the default's time)."""
SMALL_CONFIGS = [
    TmaConfig(64, 64, 64, 4, 4),
    TmaConfig(64, 128, 64, 4, 4),
    TmaConfig(64, 64, 64, 4, 3),
    TmaConfig(64, 128, 64, 4, 3),
    TmaConfig(128, 128, 64, 4, 4),
    TmaConfig(128, 128, 64, 4, 3),
    TmaConfig(128, 64, 64, 4, 3),
]
"""Tile configs tried on the others (batch 1, the 8x8 and 4x4 levels of batch 256): also 128-row tiles, which
give fewer programs than two per SM there."""
FP8_CONFIGS = [
    TmaConfig(128, 128, 128, 4, 4),
    TmaConfig(128, 128, 128, 4, 3),
    TmaConfig(128, 128, 128, 8, 4),
    TmaConfig(128, 256, 128, 8, 3),
    TmaConfig(128, 128, 64, 4, 4),
    TmaConfig(64, 128, 128, 4, 4),
]
"""Tile configs of the fp8 TMA conv (``--fp8``), on every stride-1 conv without upsampling."""


GATHER_TILES = [
    GemmTiles(m, n, k, 4, st) for m in (16, 32, 64) for n in (32, 64, 128) for k in (64, 128) for st in (3, 4)
]
"""Tile plans of the gather kernel tried with ``--gather-tiles``."""


def conv_cases(model: str, batch: int) -> list[dict]:
    """The distinct convs of ``model``'s engine lowering at ``batch`` (what each op reads and computes)."""
    torch.manual_seed(0)
    fused = FusedModel(load_unet(model, device="cpu", dtype=torch.float32), batch, torch.float16, "meta")
    cases: dict[str, dict] = {}
    for op in fused.step_ops:
        if op.kind != "conv":
            continue
        x = op.inputs[0]
        parent = x.concat.shape[1] if x.concat is not None else x.shape[1]
        p = op.params
        case = dict(
            x=list(x.shape), parent_channels=parent, channel_offset=x.channel_offset, cout=op.output.shape[1],
            ksize=p["ksize"], stride=p["stride"], padding=p["padding"], pad_end=p.get("pad_end", p["padding"]),
            upsample=p["upsample"],
            temb=p["temb"] is not None, act=p["act"], scale=p["scale"], residual=len(op.inputs) > 1,
        )  # fmt: skip
        key = json.dumps(case, sort_keys=True)
        cases.setdefault(key, {**case, "ops": []})["ops"].append(op.name)
    return list(cases.values())


def operands(case: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Random inputs laid out as the engine lays them out (a channel slice of a wider NHWC buffer)."""
    n, cin, h, w = case["x"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    parent = torch.randn((n, h, w, case["parent_channels"]), device="cuda", generator=gen).to(dtype)
    off = case["channel_offset"]
    x = parent.permute(0, 3, 1, 2)[:, off : off + cin]
    k, cout = case["ksize"], case["cout"]
    weight = torch.randn((cout, cin, k, k), device="cuda", generator=gen) / (cin * k * k) ** 0.5
    pads = case["padding"] + case["pad_end"]
    ho = (h * case["upsample"] + pads - k) // case["stride"] + 1
    wo = (w * case["upsample"] + pads - k) // case["stride"] + 1
    padding = case["padding"] if case["pad_end"] == case["padding"] else (case["padding"], case["pad_end"])
    kwargs: dict = dict(stride=case["stride"], padding=padding, activation=case["act"],
                        out_scale=case["scale"], upsample=case["upsample"])  # fmt: skip
    bias = torch.randn(cout, device="cuda", generator=gen).to(dtype)
    if case["temb"]:
        kwargs["time_emb"] = torch.randn((1, cout), device="cuda", generator=gen).to(dtype).expand(n, cout)
    if case["residual"]:
        kwargs["residual"] = torch.randn((n, ho, wo, cout), device="cuda", generator=gen).to(dtype)
        kwargs["residual"] = kwargs["residual"].permute(0, 3, 1, 2)
    kwargs["out"] = torch.empty((n, ho, wo, cout), device="cuda", dtype=dtype).permute(0, 3, 1, 2)
    return (x, pack_conv_weight(weight).to(dtype), bias), kwargs


def cudnn_call(args: tuple, kwargs: dict) -> Callable[[], None]:
    """The engine's cuDNN path: F.conv2d (+ bias), then the epilogue in torch ops."""
    x, packed, bias = args
    weight = unpack_conv_weight(packed, x.shape[1])
    padding = kwargs["padding"]
    if isinstance(padding, tuple):  # (p, p + 1) as the engine runs it: a zero first tap row and column, padding p + 1
        weight, padding = F.pad(weight, (1, 0, 1, 0)), padding[1]
    weight = weight.contiguous(memory_format=torch.channels_last)
    up, out, res = kwargs["upsample"], kwargs["out"], kwargs.get("residual")
    temb = kwargs.get("time_emb")

    def call() -> None:
        src = x if up == 1 else F.interpolate(x, scale_factor=float(up), mode="nearest")
        y = F.conv2d(src, weight, bias, stride=kwargs["stride"], padding=padding)
        if temb is not None:
            y += temb[:, :, None, None]
        y = activation_ref(y, kwargs["activation"])
        if res is not None:
            torch.add(y, res, out=out)
        else:
            out.copy_(y)
        if kwargs["out_scale"] is not None:
            out.mul_(kwargs["out_scale"])

    return call


def fp8_impls(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, kwargs: dict) -> dict[str, Callable]:
    """The fp8 TMA conv in each of ``FP8_CONFIGS`` and its default: the input as e4m3 at its own max (a dense
    copy, as the engine's GroupNorm writes it), the weight per output channel."""
    a_scale = float(x.abs().amax()) / E4M3_MAX
    x8 = quantize_e4m3_ref(x, a_scale).contiguous(memory_format=torch.channels_last)
    w8, w_scale = pack_conv_weight_fp8(unpack_conv_weight(packed.float(), x.shape[1]))
    w_scale = w_scale * a_scale
    kw = {k: v for k, v in kwargs.items() if k not in ("stride", "upsample")}
    impls: dict[str, Callable] = {}
    for cfg in FP8_CONFIGS:
        name = f"fp8-{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-w{cfg.num_warps}s{cfg.num_stages}"
        impls[name] = lambda cfg=cfg: conv2d_tma(x8, w8, bias, weight_scale=w_scale, config=cfg, **kw)
    impls["fp8-default"] = lambda: conv2d_tma(x8, w8, bias, weight_scale=w_scale, **kw)
    return impls


def gather_tile_impls(args: tuple, kwargs: dict, splits: tuple[int, ...]) -> dict[str, Callable]:
    """The gather kernel in each of ``GATHER_TILES`` that fits the conv, unsplit and at each of ``splits``."""
    x = args[0]
    cout = kwargs["out"].shape[1]
    workspace = SplitWorkspace()
    impls: dict[str, Callable] = {}
    for tiles in GATHER_TILES:
        if tiles.block_n > max(32, 2 * cout) or tiles.block_k > max(64, 2 * x.shape[1]):
            continue
        for split in (1, *splits):
            name = f"gather-{tiles.block_m}x{tiles.block_n}x{tiles.block_k}-s{tiles.num_stages}" + (
                f"-k{split}" if split > 1 else ""
            )
            impls[name] = lambda tiles=tiles, split=split: conv2d(
                *args, **kwargs, split_k=split, workspace=workspace, tiles=tiles
            )
    return impls


def sweep_case(case: dict, dtype: torch.dtype, ceiling: float, fp8: bool = False, gather_tiles: bool = False) -> dict:
    args, kwargs = operands(case, dtype)
    x, packed, bias = args
    ref = conv2d_ref(*[a.double() for a in args], **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                                      for k, v in kwargs.items() if k != "out"})  # fmt: skip
    flops, moved = conv2d_cost(args, kwargs)
    impls: dict[str, Callable[[], object]] = {
        "triton": lambda: conv2d(*args, **kwargs),
        "cudnn": cudnn_call(args, kwargs),
    }
    cout, k = case["cout"], case["ksize"]
    n, _, ho, wo = kwargs["out"].shape
    workspace = SplitWorkspace()
    splits = split_k_choices(n, x.shape[1], cout, (ho, wo), k, dtype, x.device)
    for split in splits:
        impls[f"triton-k{split}"] = lambda split=split: conv2d(*args, **kwargs, split_k=split, workspace=workspace)
    rows = n * ho * wo
    big = (rows // 128) * max(1, cout // 128) >= 2 * torch.cuda.get_device_properties(0).multi_processor_count
    if gather_tiles and not big:
        impls.update(gather_tile_impls(args, kwargs, splits))
    tma_weight = packed
    if case["upsample"] == 2:
        tma_weight = pack_upsample2_weight(unpack_conv_weight(packed, x.shape[1]))
    for cfg in TMA_CONFIGS if big else SMALL_CONFIGS:
        if cfg.block_n > max(64, 2 * cout):
            continue
        why = tma_conv_unsupported(x, cout, k, stride=case["stride"], padding=case["padding"],
                                   upsample=case["upsample"])  # fmt: skip
        if why is None:
            name = f"tma-{cfg.block_m}x{cfg.block_n}x{cfg.block_k}-w{cfg.num_warps}s{cfg.num_stages}"
            kw = {k2: v for k2, v in kwargs.items() if k2 != "stride"}
            impls[name] = lambda cfg=cfg, kw=kw: conv2d_tma(x, tma_weight, bias, config=cfg, **kw)
    if "tma-" in " ".join(impls):
        kw = {k2: v for k2, v in kwargs.items() if k2 != "stride"}
        impls["tma-default"] = lambda kw=kw: conv2d_tma(x, tma_weight, bias, **kw)
    if fp8 and case["stride"] == 1 and case["upsample"] == 1 and x.shape[1] % 16 == 0:
        impls.update(fp8_impls(x, packed, bias, kwargs))
    row = {**case, "flops": flops, "bytes": moved, "impls": {}}
    for name, call in impls.items():
        try:
            call()
            err = ((kwargs["out"].double() - ref).norm() / ref.norm()).item()
            us = time_call_us(call, 20)
        except Exception as exc:  # a config that fails to compile is recorded, not fatal
            row["impls"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            log.warning("%s %s failed: %s", case["ops"][0], name, row["impls"][name]["error"])
            continue
        tflops = flops / (us * 1e-6) / 1e12
        row["impls"][name] = {"us": us, "tflops": tflops, "pct_ceiling": 100 * tflops / ceiling, "rel_err": err}
    timed = {k: v["us"] for k, v in row["impls"].items() if "us" in v}
    row["best"] = min(timed, key=timed.get)
    log.info("%-45s x%d %s: %s", case["ops"][0], len(case["ops"]), case["x"],
             ", ".join(f"{k} {v:.1f}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:4]))  # fmt: skip
    return row


def matmul_ceiling_tflops() -> float:
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    us = time_call_us(lambda: torch.matmul(a, b, out=c), 10)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ddpm-cifar10", help="a model preset (random weights when it has none)")
    parser.add_argument("--batch", default="256,1", help="comma-separated batch sizes, swept in this order")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--only", default="", help="sweep only the convs whose op name contains one of these "
                        "comma-separated strings")  # fmt: skip
    parser.add_argument("--fp8", action="store_true", help="also the fp8 (e4m3) TMA conv, in each of FP8_CONFIGS")
    parser.add_argument("--gather-tiles", action="store_true",
                        help="also the gather kernel in each of GATHER_TILES, split or not, on the convs that do not "
                             "fill the GPU with 128x128 tiles")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cases after this long")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    start = time.perf_counter()
    ceiling = matmul_ceiling_tflops()
    result = {"env": environment(), "model": args.model, "dtype": args.dtype,
              "ceiling_tflops_bf16": ceiling, "rows": []}  # fmt: skip
    for batch in (int(b) for b in args.batch.split(",")):
        for case in conv_cases(args.model, batch):
            if not any(part in name for part in args.only.split(",") for name in case["ops"]):
                continue
            if time.perf_counter() - start > args.budget_s:
                result["stopped_early"] = True
                break
            result["rows"].append({"batch": batch, **sweep_case(case, dtype, ceiling, args.fp8, args.gather_tiles)})
            write_text_atomic(args.out, json.dumps(result, indent=1))
    write_text_atomic(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
