"""Markdown tables and bar charts from bench result JSON files (``benchmarks/readme_tables.py`` builds
docs/results.md and the README's headline table with them)."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def is_compiled(system: str) -> bool:
    """Whether a bench row is a torch.compile system (any configuration, fastdiff's model or diffusers')."""
    return system.startswith("compile") or system == "diffusers+compile"


def fastest_compile_ms(result: dict) -> float | None:
    """The fastest torch.compile row's ms per step in a bench result (the fair baseline), None without one."""
    times = [r["ms_per_step"] for r in result["results"] if is_compiled(r["system"]) and r.get("ms_per_step")]
    return min(times) if times else None


def markdown_table(result: dict) -> str:
    """One Markdown table for one bench result (rows in the order measured)."""
    cfg, env = result["config"], result["env"]
    head = (
        f"**{cfg['model']}**, batch {cfg['batch']}, {cfg['sampler']} {cfg['steps']} steps "
        f"({'random weights' if cfg.get('random_weights') else 'trained weights'}) — {env['gpu']}, "
        f"torch {env['torch']}, triton {env['triton']}, diffusers {env['diffusers']}, git {env['git_sha']}, "
        f"{env['date'][:10]}. Quality: {cfg['quality_sampler']} {cfg['quality_steps']} steps, same x_T, PSNR vs "
        "fastdiff's eager fp32 and vs diffusers fp32 (its scheduler's default loop)."
    )
    if cfg.get("cache_interval", 1) > 1:
        head += (
            f" Step caching: a full U-Net every {cfg['cache_interval']} steps in the eager and engine rows, their "
            "shallow path in between (torch.compile and diffusers run every step in full)."
        )
    lines = [
        head,
        "",
        "| system | dtype | ms/step | s/image | images/s | × diffusers+compile | × fastest compile | ready (s) "
        "| peak MiB | J/image | W | PSNR dB | vs diffusers dB | max abs diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    baseline = next(
        (r["images_per_s"] for r in result["results"] if r["system"] == "diffusers+compile" and not r.get("error")),
        None,
    )
    fastest = fastest_compile_ms(result)
    for r in result["results"]:
        if r.get("error"):
            lines.append(f"| {r['system']} | {r['dtype']} | {r['error']} ||||||||||||")
            continue
        ratio = None if baseline is None or r["images_per_s"] is None else r["images_per_s"] / baseline
        vs_compile = None if fastest is None or not r["ms_per_step"] else fastest / r["ms_per_step"]
        ready = _fmt(r["time_to_ready_s"], ".1f")
        if r["time_to_ready_s"] is not None and "kernel_cache" in r.get("extra", {}):
            ready += f" ({r['extra']['kernel_cache']} cache)"
        lines.append(
            f"| {r['system']} | {r['dtype']} | {_fmt(r['ms_per_step'], '.3f')} | {_fmt(r['s_per_image'], '.4g')} "
            f"| {_fmt(r['images_per_s'], '.4g')} | {_fmt(ratio, '.2f')} | {_fmt(vs_compile, '.2f')} | {ready} "
            f"| {_fmt(r['peak_mem_mb'], '.0f')} | {_fmt(r['energy_j_per_image'], '.3g')} "
            f"| {_fmt(r['avg_power_w'], '.0f')} | {_fmt(r['psnr_db'], '.1f')} "
            f"| {_fmt(r.get('extra', {}).get('psnr_vs_diffusers_fp32_db'), '.1f')} | {_fmt(r['max_abs_diff'], '.2e')} |"
        )
    return "\n".join(lines)


def op_tables_markdown(result: dict, top: int = 10) -> str:
    """Per engine row with an op table (``extra["op_table"]``, see ``fastdiff.bench.ops``): kernels and ops per
    step, the time per op class with its share of the ceilings, and the ``top`` slowest ops; "" when no row has
    one (a CPU run, ``--no-op-table``, a result from before op tables)."""
    parts = []
    ceil = result.get("ceilings")
    for r in result["results"]:
        table = r.get("extra", {}).get("op_table")
        if table is None:
            continue
        name = f"{r['system']}-{r['dtype']}"
        if "unavailable" in table:
            parts.append(f"**{name}** per-op table unavailable: {table['unavailable']}.")
            continue
        lines = [
            f"**{name}** per op ({table['step']}): {table['ops_per_step']} ops, "
            f"{_fmt(table['kernels_per_step'], '.0f')} kernels per step; the ops' times sum to "
            f"{table['ops_ms_per_step']:.3f} ms of {_fmt(r['ms_per_step'], '.3f')} ms/step. Ceilings: "
            f"{ceil['tflops']:.0f} TFLOP/s ({ceil['matmul']} matmul), {ceil['gbps']:.0f} GB/s (device copy).",
            "",
            "| class | ops | ms | share | TFLOP/s | % of matmul | GB/s | % of copy | mean % of ceiling |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for cls, c in table["classes"].items():
            lines.append(
                f"| {cls} | {c['ops']} | {c['ms']:.3f} | {_fmt(c['pct_of_ops_ms'], '.0f')}% "
                f"| {_fmt(c['tflops'], '.3g')} | {_fmt(c['pct_of_matmul'], '.1f')} | {_fmt(c['gbps'], '.0f')} "
                f"| {_fmt(c['pct_of_copy'], '.1f')} "
                f"| {_fmt(c['mean_pct_of_ceiling'], '.1f')} |"
            )
        lines += [
            "",
            f"The {top} slowest ops (% of ceiling: of the matmul ceiling when compute-bound, of the copy bandwidth "
            "when memory-bound):",
            "",
            "| op | kind | impl | us | GFLOP | MB | TFLOP/s | GB/s | bound | % of ceiling |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for op in sorted(table["ops"], key=lambda o: -o["us"])[:top]:
            lines.append(
                f"| {op['name']} | {op['kind']} | {op['impl']} | {op['us']:.1f} | {op['flops'] / 1e9:.3g} "
                f"| {op['bytes'] / 1e6:.3g} | {_fmt(op['tflops'], '.3g')} | {_fmt(op['gbps'], '.0f')} "
                f"| {op['bound'] or '—'} | {_fmt(op['pct_of_ceiling'], '.1f')} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def markdown_from_files(paths: list[Path]) -> str:
    return "\n\n".join(markdown_table(json.loads(Path(p).read_text())) for p in sorted(paths))


def plot_result(result: dict, path: Path) -> None:
    """Bar chart of images/s per system (log scale), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if not r.get("error")]
    labels = [f"{r['system']}\n{r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(rows)), 3.5))
    ax.bar(labels, [r["images_per_s"] for r in rows], color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylabel("images/s")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']} b{cfg['batch']} {cfg['sampler']}{cfg['steps']} — {result['env']['gpu']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
