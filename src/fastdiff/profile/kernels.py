"""Per-kernel rows of one step (time and counted FLOPs/bytes), the roofline section built from them and the
achieved rates of each op class, shared by the unconditional and the text-to-image profiles."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fastdiff.bench.breakdown import classify
from fastdiff.bench.counts import Cost, aten_op_cost
from fastdiff.bench.ops import achieved
from fastdiff.bench.roofline import roofline_point
from fastdiff.devices import synchronize

POINT_KEYS = ("name", "class", "intensity", "tflops", "gbps", "bound", "seconds")
"""What report.json keeps of each roofline point (the top kernels keep everything)."""
RATE_GROUPS = ("convolution", "gemm", "attention", "normalisation", "elementwise", "sampler", "transfer", "other")
"""The op classes of the rates table: ``fastdiff.bench.breakdown``'s, with its "convolution" split into convolutions
and GEMMs (dense matmuls: the transformer blocks' linear layers, the time MLP), which it counts together."""
GEMM_OPS = frozenset({"linear", "addmm", "mm", "matmul"})
"""aten ops of class convolution that are GEMMs (``bmm``/``baddbmm`` class as attention, as in ``breakdown``)."""
GEMM_KINDS = frozenset({"linear"})
"""Engine op kinds of class convolution that are GEMMs."""


def _conv_out_hw(shapes: list, concrete: list) -> tuple[int, int] | None:
    """Output H, W of an ``aten::conv2d``/``aten::convolution`` event from its stride/padding/dilation arguments."""
    x, w = shapes[0], shapes[1]
    stride, padding, dilation = (concrete[i] if i < len(concrete) else None for i in (3, 4, 5))
    if not (isinstance(stride, list) and isinstance(padding, list) and isinstance(dilation, list)):
        return None
    return tuple((x[2 + d] + 2 * padding[d] - dilation[d] * (w[2 + d] - 1) - 1) // stride[d] + 1 for d in range(2))  # type: ignore[return-value]


def kernel_row(
    name: str, cls: str, calls: float, us_per_call: float, cost: Cost | None, group: str | None = None
) -> dict:
    """One kernel (or op) of a step: its time per call, calls per step, counted FLOPs and bytes (None: not counted)
    and its rates-table ``group`` (default: its class)."""
    return {"name": name, "class": cls, "group": group or cls, "calls_per_step": calls, "us_per_call": us_per_call,
            "flops": None if cost is None else cost.flops, "bytes": None if cost is None else cost.bytes}  # fmt: skip


def aten_kernel_rows(run_step: Callable[[], None], device: torch.device, elem_bytes: int, steps: int = 2) -> list:
    """Per-op (kernel) rows of one eager step: every outermost ``aten::`` op of a profiled step, grouped by name and
    input shapes, with its time (CUDA: device time of the kernels it launched; CPU: its CPU time incl. children)
    and its cost from :func:`aten_op_cost`; ops with no known cost are kept with ``cost`` None."""
    run_step()
    synchronize(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            run_step()
        synchronize(device)
    groups: dict[tuple, dict] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # counted by its outermost aten op
        us = e.device_time_total if cuda else e.cpu_time_total
        concrete = list(getattr(e, "concrete_inputs", None) or [])
        key = (e.name, repr(e.input_shapes), repr(concrete[3:6]) if "conv" in e.name else "")
        row = groups.setdefault(key, {"name": e.name, "shapes": e.input_shapes, "concrete": concrete, "us": 0.0})
        row["us"] += us
        row["n"] = row.get("n", 0) + 1
    rows = []
    for row in groups.values():
        out_shape = None
        if "conv" in row["name"] and len(row["shapes"]) >= 2 and len(row["shapes"][0]) == 4:
            hw = _conv_out_hw(row["shapes"], row["concrete"])
            out_shape = None if hw is None else [0, 0, *hw]
        cost = aten_op_cost(row["name"], row["shapes"], elem_bytes, out_shape)
        op = row["name"].removeprefix("aten::")
        label = f"{op} {'x'.join(map(str, row['shapes'][0])) if row['shapes'] else ''}"
        cls = classify(row["name"])
        group = "gemm" if cls == "convolution" and op in GEMM_OPS else cls
        rows.append(kernel_row(label.strip(), cls, row["n"] / steps, row["us"] / row["n"], cost, group))
    return rows


def roofline_section(rows: list[dict], ceilings: dict, top: int) -> dict:
    """Roofline points of every row with a counted cost and a positive time; the ``top`` costliest (by time per
    step) with their bound and % of it; and how much of the kernel time the counted rows cover."""
    points = []
    for row in rows:
        if row["flops"] is None or not row["us_per_call"] > 0 or not row["bytes"]:
            continue
        point = roofline_point(Cost(row["flops"], row["bytes"]), row["us_per_call"] / 1e6, ceilings)
        points.append({**row, **point, "ms_per_step": row["us_per_call"] * row["calls_per_step"] / 1e3})
    total_ms = sum(r["us_per_call"] * r["calls_per_step"] for r in rows) / 1e3
    counted_ms = sum(p["ms_per_step"] for p in points)
    points.sort(key=lambda p: -p["ms_per_step"])
    return {
        "kernels": len(rows),
        "kernels_counted": len(points),
        "kernel_ms_per_step": total_ms,
        "counted_ms_per_step": counted_ms,
        "top": points[:top],
        "points": [{k: p[k] for k in POINT_KEYS} for p in points],
    }


def class_rates(rows: list[dict], ceilings: dict) -> dict:
    """Per op class (``RATE_GROUPS`` order, those present): the time per step of its kernels (``ms_per_step``) and of
    those with a counted cost (``counted_ms_per_step``), and the counted ones' rates as a whole (their FLOPs and
    bytes over their time; ``fastdiff.bench.ops.achieved``): ``tflops``, ``gbps``, ``intensity``, the roofline
    ``bound``, ``pct_of_ceiling`` (% of that bound's measured ceiling), ``pct_of_matmul`` and ``pct_of_copy``
    (None where nothing of the class was counted)."""
    out: dict[str, dict] = {}
    for group in RATE_GROUPS:
        members = [r for r in rows if r["group"] == group]
        if not members:
            continue
        counted = [r for r in members if r["flops"] is not None and r["bytes"] and r["us_per_call"] > 0]
        us = sum(r["us_per_call"] * r["calls_per_step"] for r in counted)
        whole = {"us": us, "flops": sum(r["flops"] * r["calls_per_step"] for r in counted),
                 "bytes": sum(r["bytes"] * r["calls_per_step"] for r in counted)}  # fmt: skip
        rates = achieved(whole, ceilings)
        out[group] = {
            "kernels": len(members),
            "kernels_counted": len(counted),
            "ms_per_step": sum(r["us_per_call"] * r["calls_per_step"] for r in members) / 1e3,
            "counted_ms_per_step": us / 1e3,
            "gflop_per_step": whole["flops"] / 1e9,
            "mb_per_step": whole["bytes"] / 1e6,
            **{k: rates[k] for k in ("tflops", "gbps", "intensity", "bound", "pct_of_ceiling", "pct_of_matmul",
                                     "pct_of_copy")},
        }  # fmt: skip
    return out
