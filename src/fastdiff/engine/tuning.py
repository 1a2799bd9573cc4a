"""The autotune: each op's candidates (``engine/candidates.py``) timed on the GPU and the fastest kept in the model's
choice map (``FusedModel.impls``), the timings cached in memory and on disk.

A conv that pairs with a partner op in a fusion (``engine/fusion.py``) is chosen on the pair's time: each candidate
pays, for each partner, the partner's time at its best when the candidate runs apart from it, and what the partner
costs while the candidate runs the fusion (nothing, or its lighter form: ``apply``). Timings are CUDA-graph replays
(:func:`time_call_us`: launch overhead excluded), keyed by what they depend on (:func:`tuning_key`: op kind, shapes,
flags, the fused partners' shapes, dtype, GPU, library versions and the kernels' source), by implementation name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from fastdiff.atomic import write_text_atomic
from fastdiff.engine.candidates import candidates
from fastdiff.engine.compile_pool import precompile
from fastdiff.engine.fusion import BoundModel, Fusion
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import Op

log = logging.getLogger(__name__)

TUNING_CACHE: dict[str, dict[str, float]] = {}
"""Per-op timings of the implementations (by :func:`tuning_key`, then implementation name), reused by later builds;
mirrored on disk in ``tuning_cache_path()`` so a new process on the same GPU / torch / triton skips the timing too."""


def source_digest(root: Path) -> str:
    """A short digest of the ``*.py`` files in ``root`` (names and bytes, in name order)."""
    digest = hashlib.sha1()
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def kernels_revision() -> str:
    """:func:`source_digest` of the kernel modules (``fastdiff/kernels``): part of every tuning-cache key, so the
    timings of other kernel code (another fastdiff version, a changed launch plan) are not reused."""
    return source_digest(Path(__file__).resolve().parent.parent / "kernels")


def tuning_cache_path() -> Path:
    """``$FASTDIFF_CACHE_DIR/engine_tuning.json`` (default ``~/.cache/fastdiff``)."""
    root = os.environ.get("FASTDIFF_CACHE_DIR") or Path.home() / ".cache" / "fastdiff"
    return Path(root) / "engine_tuning.json"


def load_tuning_cache() -> None:
    """Fill :data:`TUNING_CACHE` from disk (once; an unreadable file is logged and ignored)."""
    path = tuning_cache_path()
    if TUNING_CACHE or not path.is_file():
        return
    try:
        TUNING_CACHE.update(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable tuning cache %s: %s", path, exc)


def save_tuning_cache() -> None:
    """Write :data:`TUNING_CACHE` to disk (atomically; a failure is logged)."""
    path = tuning_cache_path()
    try:
        write_text_atomic(path, json.dumps(TUNING_CACHE, indent=0, sort_keys=True))
    except OSError as exc:
        log.warning("could not write the tuning cache %s: %s", path, exc)


def tuning_key(model: BoundModel, op: Op) -> str:
    """What an op's timing depends on: kind, shapes, strided (concat slice) or not, flags (an fp8 input scale
    only as present: its value does not change the time), the fused partners' (:meth:`Fusion.key_params`), dtype,
    GPU, library versions and the kernels' source (:func:`kernels_revision`) (a string: it is a JSON key on disk)."""
    params = {k: (v is not None if k in ("temb", "fp8_scale") else v) for k, v in op.params.items()}
    for fusion in model.fusions:
        partner = model.pairs[fusion.tag].get(op.name)
        if partner is not None:
            params.update(fusion.key_params(model, partner))
    values = [(v.shape, v.concat is not None) for v in (*op.inputs, op.output)]
    gpu = torch.cuda.get_device_name(model.device)
    versions = (torch.__version__, triton.__version__, kernels_revision())
    return repr((op.kind, values, sorted(params.items()), str(model.dtype), gpu, *versions))


def one_line_error(err: Exception) -> str:
    """The first line of an error (Triton's compile errors span many)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def candidate_times(model: BoundModel, op: Op, impls: tuple[Impl, ...], reps: int) -> dict[Impl, float]:
    """Microseconds of each of ``op``'s implementations ``impls``: the tuning cache's, the missing ones timed now
    (then ``model.ops_timed`` counts the op). One that does not fit this GPU (Triton's ``OutOfResources``: e.g. the
    larger tile of an epilogue GroupNorm on a GPU with less shared memory than Hopper's) times as infinite."""
    known = TUNING_CACHE.setdefault(tuning_key(model, op), {})
    missing = [impl for impl in impls if impl.name not in known]
    for impl in missing:
        try:
            known[impl.name] = time_call_us(model.call(op, impl), reps)
        except (OutOfResources, PTXASError, CompilationError) as err:  # a tile that does not fit or compile here
            log.info("%s: %s does not fit this GPU (%s)", op.name, impl, one_line_error(err))
            known[impl.name] = math.inf
    model.ops_timed += bool(missing)
    return {impl: known[impl.name] for impl in impls}


def compile_candidates(model: BoundModel) -> int:
    """Compile at once every candidate that :func:`choose_impls` will time (those of ops with several candidates, not
    in the tuning cache yet), in worker processes (:func:`fastdiff.engine.compile_pool.precompile`), so its timing
    loop compiles nothing; returns how many calls that covered. Writes the arena: fill it afterwards."""
    if model.device.type != "cuda":
        return 0  # the timing loop compiles each candidate at its first launch anyway
    calls = []
    for op in model.ops:
        impls = candidates(model, op)
        if len(impls) < 2:
            continue
        known = TUNING_CACHE.get(tuning_key(model, op), {})
        calls += [model.call(op, impl) for impl in impls if impl.name not in known]
    precompile(calls, model.device.type)
    return len(calls)


def choose_impls(model: BoundModel, reps: int) -> None:
    """For each op with several candidates: its candidates' times (``op.times_us``), the fastest by the pair's time
    where it fuses with a partner (module docstring) into ``model.impls``, and why (``op.why``); ``model.ops_timed``
    counts the ops that were not in the tuning cache. Runs the ops on the model's bound arena."""
    model.ops_timed = 0
    for op in model.ops:
        impls = candidates(model, op)
        if len(impls) < 2:
            continue
        timed_now = model.ops_timed
        times = candidate_times(model, op, impls, reps)
        op.times_us = {impl.name: us for impl, us in times.items()}
        why = "timed" if model.ops_timed > timed_now else "timed earlier (tuning cache, same shapes)"
        effective = dict(times)
        for partner, fusions in partners(model, op):
            used = [fusion for fusion in fusions if any(impl.fuses(fusion.tag) for impl in effective)]
            if not used:
                continue
            apart = used[0].partner_us(model, op, partner, reps)  # the partner on its own, at its best
            if apart is None:
                apart = min(candidate_times(model, partner, candidates(model, partner), reps).values())
            fused = [(fusion, fusion.fused_partner_us(model, op, partner, effective, reps)) for fusion in used]
            effective = {
                impl: us + next((cost for fusion, cost in fused if impl.fuses(fusion.tag)), apart)
                for impl, us in effective.items()
            }
            forms = "".join(f"; after -{f.tag} {cost:.1f} us" for f, cost in fused if f.partner_impl.launches)
            why += f" (apart + {partner.name} {apart:.1f} us{forms})"
        model.impls[op.name] = min(effective, key=effective.get)
        op.why = f"{why}: " + ", ".join(f"{k} {v:.1f} us" for k, v in op.times_us.items())


def partners(model: BoundModel, op: Op) -> list[tuple[Op, list[Fusion]]]:
    """``op``'s partner ops, each with the fusions that pair them (in the registry's order)."""
    found: dict[int, tuple[Op, list[Fusion]]] = {}
    for fusion in model.fusions:
        partner = model.pairs[fusion.tag].get(op.name)
        if partner is not None:
            found.setdefault(id(partner), (partner, []))[1].append(fusion)
    return list(found.values())


TIMING_WARMUP_S = 0.005
"""How long :func:`time_call_us` replays its graph before timing: the GPU's clocks drop during an idle gap (a
kernel compile between two candidates) and take milliseconds to come back."""
TIMED_REPLAYS = 5
"""Replays :func:`time_call_us` takes the median of."""
PROBES = 3
"""Eager calls :func:`time_call_us` sizes its graph by (the fastest). With one probe, a probe the host was late to
launch shrinks the graph to a call or two, whose timing then holds the graph launch's gap. That is the suspected
cause, not yet re-measured, of single ops 40-120 us above their siblings of the same shape and kernel in SD 1.5's op
table (``t2i-bench-sd15-b1-h100-2026-11-28``: GroupNorm 10 -> 69 us, a 1280x1280 GEMM 7 -> 68 us)."""


def time_call_us(call: Callable[[], None], reps: int) -> float:
    """Median microseconds per ``call()`` from :data:`TIMED_REPLAYS` replays of a CUDA graph of up to ``reps``
    calls (fewer for slow ops: the graph holds about 2 ms of work), so launch overhead does not count, after
    replaying it for :data:`TIMING_WARMUP_S` (clocks up again after an idle gap)."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probes = []
    for _ in range(PROBES):  # the fastest: one probe the host was late to launch said 2 ms for a 10 us kernel
        start.record()
        call()
        end.record()
        end.synchronize()
        probes.append(start.elapsed_time(end))
    reps = max(1, min(reps, int(2.0 / max(min(probes), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    warm_until = time.perf_counter() + TIMING_WARMUP_S
    while True:
        graph.replay()
        torch.cuda.synchronize()
        if time.perf_counter() >= warm_until:
            break
    times = []
    for _ in range(TIMED_REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]
