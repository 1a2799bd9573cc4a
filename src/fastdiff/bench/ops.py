"""The engine's per-op table: every op of one engine step with its time, FLOPs, bytes and % of the device's ceilings.

``engine_op_table`` (``fastdiff bench``: ``extra["op_table"]`` of each engine row on CUDA) lists every op of one
full engine step in order (the U-Net's fused ops, then the fused sampler step) with:

* its chosen implementation and its time per call: a CUDA graph of repeated launches, launch overhead excluded
  (``FusedModel.time_ops``; ``time_call_us`` for the sampler step);
* its FLOPs and bytes: ideal counts from its shapes (``fastdiff.bench.counts.engine_op_cost``, the formulas of
  ``kernels/cost_model.py``: each tensor read or written once);
* TFLOP/s and GB/s achieved, as % of the measured bf16 matmul ceiling and of the measured device-copy bandwidth
  (``fastdiff.bench.roofline.measure_ceilings``; the H100's dense fp16 tensor-core peak equals its bf16 one),
  and ``pct_of_ceiling``: the % of the ceiling that bounds it on the roofline (``roofline_point``: compute-bound
  above the ridge point, memory-bound below it). Ops with ``fp8`` (the engine's ``fp8=True``: an e4m3 conv or
  the GroupNorm that writes its input) are counted like the others: against the bf16 ceiling (Hopper's fp8 one is
  about 1.8x higher) and with the engine dtype's bytes for every tensor;

then a summary per op class and ``kernels_per_step``: the kernels one step launches, counted by ``torch.profiler``
on one step launched from the host (the kernels its CUDA graph replays; a cuDNN conv with its torch epilogue counts
as the kernels it is, a shortcut conv summed in its conv2 as none).
"""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING

import torch

from fastdiff.bench.breakdown import profile_breakdown
from fastdiff.bench.counts import engine_op_cost
from fastdiff.bench.roofline import roofline_point
from fastdiff.engine import FusedModel
from fastdiff.engine.tuning import time_call_us
from fastdiff.kernels.cost_model import Cost
from fastdiff.kernels.sampler_step import OP as SAMPLER_STEP
from fastdiff.kernels.sampler_step import sampler_step

if TYPE_CHECKING:
    from fastdiff.bench.systems import EngineSystem
    from fastdiff.engine.graph import SamplingLoop
    from fastdiff.samplers import Sampler

log = logging.getLogger(__name__)

ENGINE_OP_CLASS = {"conv": "convolution", "depthwise": "convolution", "gate": "convolution",
                   "linear": "convolution", "group_norm": "normalisation", "layer_norm": "normalisation",
                   "attention": "attention", "center": "elementwise", "sampler_step": "sampler"}  # fmt: skip
"""Op class (``fastdiff.bench.breakdown.OP_CLASSES``) of each engine op kind: the attention gate (three 1x1
convs) and the token GEMMs count as convolution, as in ``breakdown``."""
KERNELS_METHOD = (
    "torch.profiler device kernels (no memcpy/memset) of one full step (U-Net + sampler step + step counter) "
    "launched from the host after a warm-up step: the kernels its CUDA graph replays"
)


def step_op_rows(fused: FusedModel, reps: int = 20) -> list[dict]:
    """One row per op of ``fused.step_ops`` (model order): ``name``, ``kind``, ``class``, ``impl``, ``shape`` (its
    output's), ``us`` (per call with the chosen implementation: ``FusedModel.time_ops(reps)``), ``flops`` and
    ``bytes`` (``engine_op_cost``). An op that runs in its partner's launch (impl ``fused``: a shortcut conv summed
    in its conv2, a GroupNorm in its producer's epilogue) has time and cost 0; its FLOPs and bytes count in the
    partner's row, less what the fused launch does not move (``Fusion.saved_bytes``: the shortcut's output written
    and read back, the norm's read of its input). Needs CUDA and a bound forward; overwrites the arena's
    activations."""
    size = fused.dtype.itemsize
    costs = {op.name: engine_op_cost(op, size) for op in fused.step_ops}
    impls = fused.impls  # none yet before the first forward: every op its own row
    for fusion in fused.fusions:
        for name, partner in fused.pairs[fusion.tag].items():
            if name not in impls or not impls[name].fuses(fusion.tag) or impls[partner.name].launches:
                continue
            saved = fusion.saved_bytes(partner, size)
            pair = (costs[name], costs[partner.name])
            costs[name] = Cost(pair[0].flops + pair[1].flops, pair[0].bytes + pair[1].bytes - saved)
            costs[partner.name] = Cost(0.0, 0.0)
    rows = []
    for op, us in zip(fused.step_ops, fused.time_ops(reps), strict=True):
        cost = costs[op.name]
        impl = impls[op.name].name if op.name in impls else ""
        rows.append({"name": op.name, "kind": op.kind, "class": ENGINE_OP_CLASS[op.kind], "impl": impl,
                     "shape": list(op.output.shape), "us": us, "flops": cost.flops, "bytes": cost.bytes,
                     "fp8": "fp8_scale" in op.params})  # fmt: skip
    return rows


def sampler_step_row(fused: FusedModel, loop: SamplingLoop) -> dict:
    """The fused sampler step of ``loop`` as a row of :func:`step_op_rows`: timed like the ops (``time_call_us``)
    on copies of the loop's state (the timing writes garbage into its outputs), on the model output of one
    forward (2B rows with the loop's guidance scales when it is guided); its cost from the kernel module (reads the
    state and the model output, writes the state)."""
    sampler = loop.sampler
    out = fused.forward_from_row(loop.x_in)
    index = torch.zeros(1, dtype=torch.int64, device=loop.device)
    state = [t.clone() for t in loop.state]
    history = [state[1] if sampler.uses_h1 else None, loop.h2, loop.aux]
    seeds = loop.seeds if sampler.needs_noise else None
    args = (state[0], out, sampler.coefs, index, *(t.clone() if t is not None else None for t in history))
    kwargs = {"seeds": seeds, "guidance": loop.guidance, "clip_range": sampler.clip_range}

    def call() -> None:
        sampler_step(*args, **kwargs, out=tuple(state))

    flops, moved = SAMPLER_STEP.cost(args, kwargs)
    return {"name": "sampler_step", "kind": "sampler_step", "class": "sampler", "impl": "triton",
            "shape": list(loop.x.shape), "us": time_call_us(call, 20), "flops": flops, "bytes": moved}  # fmt: skip


def achieved(row: dict, ceilings: dict | None = None) -> dict:
    """``row`` (``us``, ``flops``, ``bytes``) with ``tflops`` and ``gbps`` achieved; with ``ceilings`` (from
    ``measure_ceilings``) also ``intensity`` (FLOP/byte), ``bound`` ("compute" or "memory", by the roofline),
    ``pct_of_matmul`` (TFLOP/s as % of the matmul ceiling), ``pct_of_copy`` (GB/s as % of the copy bandwidth) and
    ``pct_of_ceiling`` (the one of the two that bounds it). None for all of them when the time is not positive."""
    if not row["us"] > 0:
        roofline = () if ceilings is None else ("intensity", "bound", "pct_of_ceiling", "pct_of_matmul", "pct_of_copy")
        return {**row, **dict.fromkeys(("tflops", "gbps", *roofline))}
    out = {**row, "tflops": row["flops"] / row["us"] / 1e6, "gbps": row["bytes"] / row["us"] / 1e3}
    if ceilings is not None:
        point = roofline_point(Cost(row["flops"], row["bytes"]), row["us"] / 1e6, ceilings)
        out.update(intensity=point["intensity"], bound=point["bound"], pct_of_ceiling=point["pct_of_bound"],
                   pct_of_matmul=100 * out["tflops"] / ceilings["tflops"],
                   pct_of_copy=100 * out["gbps"] / ceilings["gbps"])  # fmt: skip
    return out


def roofline_floor_ms(ops: list[dict]) -> dict[str, float]:
    """Per op class, the ms per step its ``ops`` (rows of :func:`achieved` with ceilings) would take each at the
    ceiling that bounds it on the roofline (``us * pct_of_ceiling / 100``): the floor of the op graph, launch gaps
    and all other overheads aside. An op already past its ceiling (an Upsample2D conv: counted as the conv of the
    upsampled image, run as 4/9 of it) counts its own time; ops without a time (fused into another) count 0."""
    floor: dict[str, float] = {}
    for op in ops:
        us, pct = op.get("us"), op.get("pct_of_ceiling")
        ms = us * min(pct, 100.0) / 100 / 1e3 if us and pct is not None else 0.0
        floor[op["class"]] = floor.get(op["class"], 0.0) + ms
    return floor


def op_table(rows: list[dict], ceilings: dict, kernels_per_step: int | None = None) -> dict:
    """The per-op table of one step from its op rows (:func:`step_op_rows` + :func:`sampler_step_row`, or any rows
    with ``name``, ``kind``, ``class``, ``impl``, ``us``, ``flops``, ``bytes``) under ``ceilings``.

    Returns ``ops_per_step``, ``kernels_per_step`` (as given), ``ops_ms_per_step`` (the ops' times summed: the step
    without launch gaps), ``floor_ms_per_step`` (:func:`roofline_floor_ms` summed; None when an op is ``fp8``: its
    % of ceiling is of the bf16 one), ``classes`` (per op class, in
    order of first appearance: ``ops``, ``ms``, ``pct_of_ops_ms``, ``tflops`` and ``gbps`` of the class as a whole
    (its FLOPs and bytes over its time), their ``pct_of_matmul`` and ``pct_of_copy``, ``mean_pct_of_ceiling``: the
    mean over its ops of each op's ``pct_of_ceiling``, and ``floor_ms``) and ``ops`` (every row through
    :func:`achieved`).
    """
    ops = [achieved(r, ceilings) for r in rows]
    total_us = sum(o["us"] for o in ops)
    fp8 = any(o.get("fp8") for o in ops)  # timed against the bf16 ceilings: no floor from them
    floor = roofline_floor_ms(ops)
    classes: dict[str, dict] = {}
    for cls in dict.fromkeys(o["class"] for o in ops):
        members = [o for o in ops if o["class"] == cls]
        us = sum(o["us"] for o in members)
        whole = achieved({"us": us, "flops": sum(o["flops"] for o in members),
                          "bytes": sum(o["bytes"] for o in members)}, ceilings)  # fmt: skip
        pcts = [o["pct_of_ceiling"] for o in members if o["pct_of_ceiling"] is not None]
        classes[cls] = {
            "ops": len(members), "ms": us / 1e3, "pct_of_ops_ms": 100 * us / total_us if total_us > 0 else None,
            "tflops": whole["tflops"], "gbps": whole["gbps"], "pct_of_matmul": whole["pct_of_matmul"],
            "pct_of_copy": whole["pct_of_copy"], "mean_pct_of_ceiling": statistics.fmean(pcts) if pcts else None,
            "floor_ms": None if fp8 else floor[cls],
        }  # fmt: skip
    return {"ops_per_step": len(ops), "kernels_per_step": kernels_per_step, "ops_ms_per_step": total_us / 1e3,
            "floor_ms_per_step": None if fp8 else sum(floor.values()), "classes": classes, "ops": ops}  # fmt: skip


def count_step_kernels(loop: SamplingLoop, x_t: torch.Tensor, seeds: torch.Tensor) -> int | None:
    """Kernels one full step of ``loop`` launches (see ``KERNELS_METHOD``); None when the profiler saw none. The
    loop's state is reloaded from ``x_t``: its next run starts over anyway (``SamplingLoop.run`` loads)."""
    step = torch.no_grad()(loop.step)
    loop.load(x_t, seeds)
    step()  # warm-up outside the graph: anything lazily initialised happens here, not in the count
    loop.load(x_t, seeds)  # back to step 0: a full step also with step caching
    kernels = profile_breakdown(step, loop.device, steps=1, warmup=0)["kernels_seen"]
    return kernels or None


def engine_op_table(
    system: EngineSystem, sampler: Sampler, x_t: torch.Tensor, seeds: torch.Tensor, ceilings: dict
) -> dict:
    """:func:`op_table` of the prepared engine system's step with ``sampler`` (its loop at ``x_t``'s batch), with
    ``kernels_per_step`` counted (:func:`count_step_kernels`), ``step`` and ``method`` saying what was measured.
    ``{"unavailable": reason}`` when the engine runs the model's own forward. Needs CUDA; takes about a second."""
    loop = system.loop(sampler, x_t.shape[0])
    fused = system.engine.current_step_model
    if not isinstance(fused, FusedModel):
        return {"unavailable": "the engine runs this model's own forward: no fused ops to list"}
    kernels = count_step_kernels(loop, x_t, seeds)
    table = op_table([*step_op_rows(fused), sampler_step_row(fused, loop)], ceilings, kernels)
    return {
        "step": f"one full step of the {sampler.name} loop: the U-Net's ops in model order, then the sampler step"
        + (" (shallow steps of the step cache run a subset of the U-Net ops)" if system.cache_interval > 1 else ""),
        "method": "us per call: a CUDA graph of repeated launches of the op (launch overhead excluded); FLOPs and "
        "bytes: ideal counts (fastdiff.bench.counts); pct_of_matmul / pct_of_copy: of the run's measured ceilings "
        "(top-level 'ceilings'); pct_of_ceiling: of the one that bounds the op on the roofline; kernels_per_step: "
        + KERNELS_METHOD,
        **table,
    }  # fmt: skip
