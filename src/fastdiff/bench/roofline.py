"""Measured compute and memory-bandwidth ceilings, roofline points of timed kernels, and the roofline plot."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastdiff.errors import FastdiffError
from fastdiff.images import save_figure_atomic
from fastdiff.kernels.cost_model import Cost

log = logging.getLogger(__name__)


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` after ``warmup`` untimed calls: CUDA events on CUDA, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_fn(n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=c)


def _copy_fn(nbytes: int, device: torch.device) -> Callable[[], object]:
    src = torch.ones(nbytes, device=device, dtype=torch.uint8)  # written, so no lazily mapped zero pages
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure_ceilings(
    device: torch.device, dtype: torch.dtype | None = None, *, matmul_size: int | None = None,
    copy_bytes: int | None = None, repeats: int = 10, warmup: int = 3,
) -> dict:  # fmt: skip
    """Measure (never assume) peak compute and memory bandwidth on ``device``.

    Compute: an n x n x n matmul (2*n^3 FLOPs; CUDA: bf16, n = 8192; CPU: fp32, n = 2048). Bandwidth: a
    device-to-device copy of ``copy_bytes`` (CUDA 1 GiB, CPU 256 MiB), counted as read + write = 2x its size.
    Each is the median of ``repeats`` runs after ``warmup`` untimed ones. Returns ``tflops``, ``gbps``,
    ``matmul`` (what ran), ``copy_bytes``, ``method``, ``device`` and ``dtype``.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    n = matmul_size or (8192 if cuda else 2048)
    copy_bytes = copy_bytes or ((1 << 30) if cuda else (256 << 20))
    mm_s = _median_seconds(_matmul_fn(n, device, dtype), device, repeats, warmup)
    copy_s = _median_seconds(_copy_fn(copy_bytes, device), device, repeats, warmup)
    if cuda:
        torch.cuda.empty_cache()
    timer = "CUDA events" if cuda else "time.perf_counter"
    result = {
        "tflops": 2 * n**3 / mm_s / 1e12,
        "gbps": 2 * copy_bytes / copy_s / 1e9,
        "matmul": f"{str(dtype).removeprefix('torch.')} {n}x{n}x{n}",
        "copy_bytes": copy_bytes,
        "method": f"median of {repeats} runs after {warmup} warm-ups ({timer}); copy counts read + write",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
    }
    log.info("ceilings on %s: %.2f TFLOP/s (%s), %.1f GB/s", result["device"], result["tflops"],
             result["matmul"], result["gbps"])  # fmt: skip
    return result


def roofline_point(cost: Cost, seconds: float, ceilings: dict) -> dict:
    """Where a kernel of ``cost`` that took ``seconds`` sits under ``ceilings`` (from :func:`measure_ceilings`).

    ``bound`` is "memory" when its intensity is below the ridge point (peak FLOP/s over peak B/s), else
    "compute"; ``pct_of_bound`` = achieved / attainable * 100, attainable = min(peak FLOP/s, intensity * peak B/s)
    (for a memory-bound point this equals achieved bandwidth / peak bandwidth, also when it does no FLOPs).
    """
    if not seconds > 0:
        raise ValueError(f"roofline_point: seconds must be positive, got {seconds}")
    peak_flops, peak_bw = ceilings["tflops"] * 1e12, ceilings["gbps"] * 1e9
    ridge = peak_flops / peak_bw
    flops_s, bytes_s = cost.flops / seconds, cost.bytes / seconds
    memory = cost.intensity < ridge
    attainable = min(peak_flops, cost.intensity * peak_bw)
    return {
        "flops": cost.flops,
        "bytes": cost.bytes,
        "seconds": seconds,
        "tflops": flops_s / 1e12,
        "gbps": bytes_s / 1e9,
        "intensity": cost.intensity,
        "ridge": ridge,
        "bound": "memory" if memory else "compute",
        "attainable_tflops": attainable / 1e12,
        "pct_of_bound": 100 * (bytes_s / peak_bw if memory else flops_s / peak_flops),
    }


def plot_roofline(points: list[dict], ceilings: dict, path: Path, title: str, label_top: int = 6) -> None:
    """Log-log roofline: the bandwidth slope and compute roof, one marker per point (``intensity``, ``tflops``,
    optionally ``name`` and ``seconds``; points with no FLOPs cannot be placed and are skipped); the ``label_top``
    slowest points are labelled. Written atomically (a temp file in the same directory, then renamed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise FastdiffError("the roofline plot needs matplotlib (pip install matplotlib)") from exc
    path = Path(path)
    peak, bw = ceilings["tflops"], ceilings["gbps"] / 1e3  # TFLOP/s and TB/s: attainable TFLOP/s = I * bw
    ridge = peak / bw
    shown = [p for p in points if p["intensity"] > 0 and p["tflops"] > 0]
    if len(shown) < len(points):
        log.debug("roofline: %d point(s) with no FLOPs not drawn", len(points) - len(shown))
    xs_all = [p["intensity"] for p in shown] + [ridge]
    lo, hi = min(xs_all) / 4, max(xs_all) * 4
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    fig = Figure(figsize=(8, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs, [min(peak, x * bw) for x in xs], color="black", linewidth=1.5)
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
    ax.text(hi, peak * 1.08, f"{peak:.1f} TFLOP/s ({ceilings.get('matmul', 'matmul')})", ha="right", fontsize=8)
    ax.text(lo * 1.3, lo * 1.3 * bw * 1.8, f"{ceilings['gbps']:.0f} GB/s", fontsize=8)
    for bound, color in (("memory", "tab:blue"), ("compute", "tab:red")):
        sel = [p for p in shown if p.get("bound", "memory" if p["intensity"] < ridge else "compute") == bound]
        if sel:
            ax.scatter([p["intensity"] for p in sel], [p["tflops"] for p in sel], s=18, color=color,
                       alpha=0.75, label=f"{bound}-bound ({len(sel)})")  # fmt: skip
    for p in sorted(shown, key=lambda p: -p.get("seconds", 0.0))[:label_top]:
        if "name" in p:
            ax.annotate(p["name"], (p["intensity"], p["tflops"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ys = [p["tflops"] for p in shown] + [lo * bw]
    ax.set_ylim(max(min(ys) / 3, 1e-12), peak * 2.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)
    if shown:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)
    log.info("roofline written to %s (%d points)", path, len(shown))
