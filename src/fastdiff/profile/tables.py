"""Markdown pieces that the unconditional and the text-to-image reports share: the ceilings line, the time-by-op-class
table and the roofline tables."""

from __future__ import annotations

from fastdiff.bench.breakdown import OP_CLASSES


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def fmt(v: float | None, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def ceilings_line(ceil: dict) -> str:
    return (
        f"Measured ceilings (by this command): **{ceil['tflops']:.1f} TFLOP/s** ({ceil['matmul']} matmul), "
        f"**{ceil['gbps']:.0f} GB/s** (device copy of {ceil['copy_bytes'] / 2**20:.0f} MiB, read + write); "
        f"{ceil['method']}."
    )


def breakdown_lines(backends: dict) -> list[str]:
    """The table of ms per step by op class (and idle) of each backend's ``breakdown``, the chart, each backend's
    profiled run and the method."""
    names = list(backends)
    lines = ["| class | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for cls in (*OP_CLASSES, "idle"):
        cells = []
        for n in names:
            bd = backends[n]["breakdown"]
            ms = bd["idle_ms"] if cls == "idle" else bd["per_class_ms"][cls]
            cells.append(f"{ms:.3f} ({100 * ms / bd['end_to_end_ms']:.0f}%)")
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    e2e = [f"**{backends[n]['breakdown']['end_to_end_ms']:.3f}**" for n in names]
    lines.append("| **end-to-end step** | " + " | ".join(e2e) + " |")
    kernels = [fmt(backends[n]["breakdown"]["kernels_per_step"], ".0f") for n in names]
    lines.append("| kernels per step | " + " | ".join(kernels) + " |")
    lines += ["", "![breakdown](breakdown.png)", ""]
    for n in names:
        lines.append(f"- {n}: {backends[n]['breakdown']['profiled_run']}.")
    lines += ["", f"Method: {backends[names[0]]['breakdown']['method']}.", ""]
    return lines


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f}%"


def roofline_lines(backends: dict, class_key: str = "class") -> list[str]:
    """Per backend: the counted share of the kernel time, the roofline chart and its top kernels (or why skipped),
    each with its row's ``class_key`` as its class; then how the counts and times were made."""
    lines: list[str] = []
    for n, b in backends.items():
        roof = b["roofline"]
        if "skipped" in roof:
            lines += [f"**{n}**: skipped: {roof['skipped']}.", ""]
            continue
        lines += [
            f"**{n}**: {roof['kernels_counted']} of {roof['kernels']} kernels counted, "
            f"{roof['counted_ms_per_step']:.3f} of {roof['kernel_ms_per_step']:.3f} ms per step. "
            f"![roofline {n}](roofline-{n}.png)",
            "",
            "| kernel | class | calls/step | ms/step | GFLOP | MB | FLOP/B | TFLOP/s | GB/s | bound | % of bound |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for p in roof["top"]:
            lines.append(
                f"| {p['name']} | {p[class_key]} | {p['calls_per_step']:.0f} | {p['ms_per_step']:.4f} | "
                f"{p['flops'] / 1e9:.3g} | {p['bytes'] / 1e6:.3g} | {p['intensity']:.3g} | {p['tflops']:.3g} | "
                f"{p['gbps']:.0f} | {p['bound']} | {p['pct_of_bound']:.0f}% |"
            )
        if any(p["pct_of_bound"] > 100 for p in roof["top"]):
            lines += ["Above 100%: the kernel beat the measured ceiling, so that matmul or copy is not this device's "
                      "true peak (common on CPUs, where the convolution library outruns torch.mm).", ""]  # fmt: skip
        lines.append("")
    lines += [
        "Counted FLOPs and bytes are ideal (each tensor read or written once; see fastdiff.bench.counts); time per "
        "kernel: the engine's ops each timed in a CUDA graph of repeated launches, eager ops from the profiler trace "
        "(device time of the kernels each launched, or CPU time on the CPU).",
        "",
    ]
    return lines
