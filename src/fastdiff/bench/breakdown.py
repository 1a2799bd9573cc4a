"""Time of one sampling step broken down by op class, from a ``torch.profiler`` trace.

Classes (``OP_CLASSES``):

* convolution: every convolution (cuDNN/cutlass/xmma kernels and their layout transforms, our ``_conv2d``
  and ``_depthwise`` kernels, cuDNN's winograd ones) and every dense matmul (``mm``/``addmm``/``linear``/gemm): in the
  U-Net those are the time MLP and the attention's q/k/v/out projections, which our engine runs as 1x1 convs.
  Our ``_attention_gate_kernel`` counts here too: it is three 1x1 convs around a ReLU and a sigmoid (eager runs
  it as convs plus elementwise ops), not softmax attention.
* normalisation: group/layer/batch norm (incl. torch's ``RowwiseMoments``, our ``_gn_*`` kernels).
* attention: SDPA (flash/efficient/cuDNN/math, ``fmha``), ``softmax`` and ``bmm``, our ``_attention_kernel``.
* elementwise: pointwise maths, activations and device-side copies/cat/pad/upsample.
* sampler: kernels launched under a ``fastdiff.sampler`` range (see ``sampler_range``), our ``_sampler_step``.
* transfer: ``Memcpy HtoD`` / ``Memcpy DtoH`` device events only.
* other: everything else (memsets, reductions, framework bookkeeping such as ``aten::empty``/``aten::view``).

Fused kernels count under their main op: a torch.compile ``triton_*_fused_*`` kernel by the op names in its
name (attention > normalisation > convolution > elementwise), so a conv's fused bias + activation counts as
convolution and a group norm's fused SiLU as normalisation. A kernel also takes the class of the outermost
convolution/normalisation/attention op that launched it (eager's conv bias add, GroupNorm's elementwise pass);
kernels replayed from a CUDA graph have no launching op, so only their names count.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)

OP_CLASSES = ("convolution", "normalisation", "attention", "elementwise", "sampler", "transfer", "other")
SAMPLER_RANGE = "fastdiff.sampler"
"""Name of the ``record_function`` range whose kernels count as "sampler"."""
_STRONG = ("convolution", "normalisation", "attention")


def _words(*words: str) -> str:
    """Regex matching any of ``words`` not glued to other letters (``add`` in ``fused_add_mul``, not ``addmm``)."""
    return r"(?<![a-z])(?:" + "|".join(words) + r")(?![a-z])"


_RULES = (  # first match wins, on the lower-cased name
    ("transfer", r"memcpy ?(?:htod|dtoh)"),
    ("sampler", re.escape(SAMPLER_RANGE) + r"|_sampler_step"),
    ("convolution", r"attention_gate"),
    ("attention", r"attention|attn|sdpa|flash|fmha|softmax|mem_?eff|" + _words("bmm", "baddbmm")),
    ("normalisation", r"(?:group|layer|batch|rms|instance)_?norm|rowwisemoments|computefusedparams|welford|_gn_"),
    (
        "convolution",
        r"conv(?!ert)|fprop|dgrad|wgrad|winograd|depthwise|nchwtonhwc|nhwctonchw|gemm|gemv|nvjet|splitkreduce|cublas|cutlass|cudnn|xmma|"
        + _words("mm", "addmm", "linear", "matmul"),
    ),
    (
        "elementwise",
        r"elementwise|pointwise|triton_(?:poi|per|red)_|cpp_fused|upsample|catarray|memcpy ?dtod|"
        + _words(
            *"add sub mul div neg exp log sqrt rsqrt pow clamp where fill copy cat pad lerp sin cos abs arange silu "
            "gelu relu sigmoid tanh mish softplus hardswish addcmul clone constant_pad_nd interpolate".split()
        ),
    ),
)
_COMPILED = tuple((cls, re.compile(pattern)) for cls, pattern in _RULES)


def classify(name: str) -> str:
    """The op class (one of ``OP_CLASSES``) of a profiler event or kernel name, from the name alone."""
    lowered = name.lower()
    if lowered.startswith("triton_"):  # Inductor names a kernel that reads SDPA's output after SDPA: not attention
        lowered = re.sub(r"_scaled_dot_product_\w*?attention", "", lowered)
    for cls, pattern in _COMPILED:
        if pattern.search(lowered):
            return cls
    return "other"


def sampler_range() -> record_function:
    """``with sampler_range(): sampler.step(...)`` marks the sampler step for ``profile_breakdown``."""
    return record_function(SAMPLER_RANGE)


def _chain(op: Any) -> list[Any]:
    """``op`` and its CPU ancestors, innermost first."""
    chain = []
    while op is not None:
        chain.append(op)
        op = op.cpu_parent
    return chain


def _attribute(name: str, chain: list[Any]) -> str:
    """Class of an event ``name`` (a kernel, or a CPU op's self time) launched under the ops ``chain``.

    Memcpy HtoD/DtoH stays transfer; anything under ``SAMPLER_RANGE`` is sampler; else the outermost op
    (``ns::name``) of a strong class (convolution/normalisation/attention) claims it, so a conv's bias add, a
    group norm's elementwise pass and SDPA's bmm/softmax go to their op; else the name decides, and a name of
    class "other" (``aten::empty``) inherits the class of its innermost classified ancestor.
    """
    own = classify(name)
    if own == "transfer":
        return own
    if any(op.name == SAMPLER_RANGE for op in chain):
        return "sampler"
    op_classes = [classify(op.name) for op in chain if "::" in op.name]
    strong = [cls for cls in op_classes if cls in _STRONG]
    if strong:
        return strong[-1]
    if own != "other":
        return own
    return next((cls for cls in op_classes if cls != "other"), "other")


def _device_rows(events: list[Any]) -> list[tuple[str, float, Any]]:
    """(kernel name, device us, launching CPU op or None) for every kernel/memcpy/memset device event."""
    device = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    pending = Counter((e.name, e.time_range.elapsed_us()) for e in device)  # user annotations: ranges, not work
    rows = []
    for op in events:  # a kernel is listed in its launching op's .kernels with the same name and duration
        if op.device_type == DeviceType.CPU:
            for kernel in op.kernels:
                key = (kernel.name, kernel.duration)
                if pending[key] > 0:
                    pending[key] -= 1
                    rows.append((kernel.name, kernel.duration, op))
    rows += [(name, us, None) for (name, us), n in pending.items() for _ in range(n)]  # e.g. no CPU op linked
    return rows


def _method(cuda: bool, steps: int, warmup: int) -> str:
    what = (
        "device time of every kernel/memcpy/memset event (not GPU idle gaps or host time; kernels replayed from a "
        "CUDA graph count if the profiler recorded them, see kernels_seen, and have no launching op)"
        if cuda
        else "self CPU time of every op (its time minus its children's, so nested ops count once)"
    )
    return (
        f"torch.profiler trace of {steps} steps after {warmup} warm-up steps: {what}, summed per class and divided "
        f"by the steps; class from the event name, overridden by the outermost launching op of class "
        f"convolution/normalisation/attention and by an enclosing '{SAMPLER_RANGE}' range"
    )


def profile_breakdown(
    run_step: Callable[[], None], device: torch.device, steps: int = 3, warmup: int = 2, top: int = 15
) -> dict[str, Any]:
    """Profile ``steps`` calls of ``run_step`` (after ``warmup`` unprofiled ones) and sum the time per op class.

    ``run_step`` should wrap its sampler update in ``sampler_range()``. On CUDA the times are device kernel
    times, on the CPU self CPU times of ops (see the returned "method"). Returns ``method``, ``per_class_ms``
    (ms per step, every class of ``OP_CLASSES``), ``total_ms`` (their sum), ``wall_ms`` (wall time per profiled
    step, profiler overhead included), ``idle_ms`` (``wall_ms - total_ms``: the profiled step's time outside every
    counted kernel or op), ``kernels_seen`` (device kernel events in the window; 0 on CUDA means the
    profiler did not see the kernels, e.g. of a CUDA-graph replay: profile a run without graphs) and ``events``
    (the ``top`` (name, class) pairs by time: ``name``, ``class``, ``ms_per_step``, ``calls_per_step`` and the
    ``input_shapes`` of the first call's op, [] for a kernel with no launching op).

    On the CPU the profiler slows every op down, so ``per_class_ms`` add up to ``wall_ms`` (with ``idle_ms``), not
    to a step timed without the profiler: shares of the step must be taken of ``wall_ms``.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        run_step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        sync()
        wall_s = time.perf_counter() - start
    events = list(prof.events())
    if cuda:
        rows = [(name, us, op, _chain(op)) for name, us, op in _device_rows(events)]
    else:
        cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
        rows = [(e.name, e.self_cpu_time_total, e, _chain(e.cpu_parent)) for e in cpu]
    kernels_seen = sum(1 for name, *_ in rows if cuda and not name.startswith(("Memcpy", "Memset")))
    if cuda and kernels_seen == 0:
        log.warning("no device kernels in the trace (CUDA-graph replay?): profile a run without graphs")

    per_class = dict.fromkeys(OP_CLASSES, 0.0)
    groups: dict[tuple[str, str], list[Any]] = {}
    for name, us, op, chain in rows:
        cls = _attribute(name, chain)
        per_class[cls] += us
        group = groups.setdefault((name, cls), [0.0, 0, op.input_shapes if op is not None else []])
        group[0] += us
        group[1] += 1
    scale = 1e-3 / steps  # us in the window -> ms per step
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    total_ms, wall_ms = sum(per_class.values()) * scale, wall_s * 1e3 / steps
    return {
        "method": _method(cuda, steps, warmup),
        "device": str(device),
        "per_class_ms": {cls: us * scale for cls, us in per_class.items()},
        "total_ms": total_ms,
        "wall_ms": wall_ms,
        "idle_ms": max(wall_ms - total_ms, 0.0),
        "kernels_seen": kernels_seen,
        "events": [
            {"name": name, "class": cls, "ms_per_step": us * scale, "calls_per_step": n / steps, "input_shapes": shp}
            for (name, cls), (us, n, shp) in ranked
        ],
    }


def breakdown_figure(rows: dict[str, dict[str, float]], title: str) -> Any:
    """Stacked horizontal bars, one per backend (``rows``: label -> per-class ms), each labelled with its total;
    the legend sits below the axes, clear of every bar. Returns the matplotlib ``Figure`` (Agg, no pyplot)."""
    from matplotlib.figure import Figure

    labels = list(rows)
    fig = Figure(figsize=(9, 1.6 + 0.6 * max(len(labels), 1)), layout="constrained")
    ax = fig.add_subplot()
    left = [0.0] * len(labels)
    for i, cls in enumerate(OP_CLASSES):
        widths = [float(rows[label].get(cls, 0.0)) for label in labels]
        ax.barh(labels, widths, left=left, label=cls, color=f"C{i}")  # tab10, fixed per class
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, total in enumerate(left):
        ax.annotate(f"{total:.3g} ms", (total, y), xytext=(3, 0), textcoords="offset points", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_xlim(0, max(left, default=0.0) * 1.15 or 1.0)
    ax.set_title(title)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=len(OP_CLASSES), fontsize="small")
    return fig


def plot_breakdown(rows: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """:func:`breakdown_figure` written to ``path`` as a PNG, all or nothing."""
    from fastdiff.images import save_figure_atomic

    save_figure_atomic(breakdown_figure(rows, title), Path(path), dpi=120)
