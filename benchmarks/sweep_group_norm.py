"""One-call GPU sweep of GroupNorm (+ SiLU) launch plans at a model's own norm shapes: the plan ``group_norm_act``
picks and every (groups per block, register or streamed) alternative, each timed as CUDA-graph replays and checked
against ``group_norm_act_ref``; GB/s and % of the device-copy bandwidth measured in the same run.

    PYTHONPATH=src python benchmarks/sweep_group_norm.py --model ddpm-cifar10 --batch 256 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import triton

import fastdiff.kernels.group_norm_act as gn
from fastdiff.atomic import write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.tuning import time_call_us
from fastdiff.kernels.fp8 import FP8_DTYPE
from fastdiff.models import load_unet

log = logging.getLogger("benchmarks.sweep_group_norm")


def norm_cases(model: str, batch: int) -> list[dict]:
    """The distinct GroupNorms of ``model``'s engine lowering at ``batch``."""
    torch.manual_seed(0)
    fused = FusedModel(load_unet(model, device="cpu", dtype=torch.float32), batch, torch.float16, "meta")
    cases: dict[str, dict] = {}
    for op in fused.step_ops:
        if op.kind == "group_norm":
            x = op.inputs[0]
            parent = x.concat.shape[1] if x.concat is not None else x.shape[1]
            case = dict(x=list(x.shape), parent_channels=parent, groups=op.params["groups"], act=op.params["act"])
            cases.setdefault(json.dumps(case), {**case, "ops": []})["ops"].append(op.name)
    return list(cases.values())


def plans(n: int, c: int, hw: int, groups: int) -> dict[str, gn._Plan]:
    """The auto plan and the alternatives: for each power-of-two lane width that holds a group, as many whole
    groups as fit, kept in registers (when the tile fits 64K elements; 8 or 16 warps) or streamed twice (row tiles
    of 4K or 8K elements; 4 or 8 warps)."""
    cg = c // groups
    hw_pad = triton.next_power_of_2(hw)
    out = {"auto": gn._plan(n, c, hw, groups, torch.device("cuda"), "auto")}
    for block_c in (16, 32, 64, 128, 256):
        if block_c < cg or (block_c // 2 >= c and block_c > 16):
            continue
        gpb = min(groups, block_c // cg)
        for warps in (8, 16):
            if hw_pad * block_c <= 65536:
                out[f"reg-c{block_c}-w{warps}"] = gn._Plan("single_pass", block_c, gpb, hw_pad, True, warps)
        for tile in (4096, 8192):
            for warps in (4, 8):
                block_hw = max(1, min(hw_pad, tile // block_c))
                out[f"stream-c{block_c}-t{tile}-w{warps}"] = gn._Plan("single_pass", block_c, gpb, block_hw, False,
                                                                      warps)  # fmt: skip
    return out


def sweep_case(case: dict, copy_gbps: float, with_fp8: bool = True) -> dict:
    n, c, h, w = case["x"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    parent = torch.randn((n, h, w, case["parent_channels"]), device="cuda", generator=gen).half()
    x = parent.permute(0, 3, 1, 2)[:, :c]
    weight = (1 + 0.1 * torch.randn(c, device="cuda", generator=gen)).half()
    bias = (0.1 * torch.randn(c, device="cuda", generator=gen)).half()
    groups, act = case["groups"], case["act"]
    ref = gn.group_norm_act_ref(x.double(), groups, weight.double(), bias.double(), 1e-5, activation=act)
    row = {**case, "plans": {}}
    real_plan = gn._plan
    for fp8 in (False, True) if with_fp8 else (False,):
        out = torch.empty((n, h, w, c), device="cuda", dtype=FP8_DTYPE if fp8 else torch.float16).permute(0, 3, 1, 2)
        moved = n * c * h * w * (2 + (1 if fp8 else 2))
        for name, plan in plans(n, c, h * w, groups).items():
            gn._plan = lambda *args, plan=plan: plan  # noqa: B023 - called only in this iteration
            try:
                scale = 0.05 if fp8 else None

                def call(out=out, scale=scale) -> None:
                    gn.group_norm_act(x, groups, weight, bias, 1e-5, activation=act, out=out, fp8_scale=scale)

                call()
                got = out.double() * (0.05 if fp8 else 1.0)
                err = ((got - ref).norm() / ref.norm()).item()
                us = time_call_us(call, 20)
                key = f"{'fp8-' if fp8 else ''}{name}"
                row["plans"][key] = {"us": us, "gbps": moved / us / 1e3, "pct_copy": 100 * moved / us / 1e3 / copy_gbps,
                                     "rel_err": err, "plan": repr(plan)}  # fmt: skip
            except Exception as exc:  # a plan that fails to compile is recorded, not fatal
                row["plans"][f"{'fp8-' if fp8 else ''}{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                gn._plan = real_plan
    timed = {k: v["us"] for k, v in row["plans"].items() if "us" in v}
    log.info("%-40s x%d %s: %s", case["ops"][0], len(case["ops"]), case["x"],
             ", ".join(f"{k} {v:.1f}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:5]))  # fmt: skip
    log.info("    auto %.1f, fp8-auto %.1f", timed.get("auto", 0), timed.get("fp8-auto", 0))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ddpm-cifar10", help="a model preset (random weights when it has none)")
    parser.add_argument("--batch", default="256", help="comma-separated batch sizes")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--no-fp8", action="store_true", help="time the fp16-output plans only")
    parser.add_argument("--only", default="", help="comma-separated op names: sweep only the norms of these ops")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    copy_gbps = measure_ceilings(torch.device("cuda"))["gbps"]
    result = {"env": environment(), "model": args.model, "copy_gbps": copy_gbps, "rows": []}
    for batch in (int(b) for b in args.batch.split(",")):
        for case in norm_cases(args.model, batch):
            if args.only and not set(case["ops"]) & set(args.only.split(",")):
                continue
            result["rows"].append({"batch": batch, **sweep_case(case, copy_gbps, not args.no_fp8)})
            write_text_atomic(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
