"""The bench's Markdown table: one row per system, errors spanning the row, speed-up vs diffusers+compile."""

from __future__ import annotations

from fastdiff.bench.report import fastest_compile_ms, markdown_table


def row(system: str, images_per_s: float | None, error: str | None = None, **extra) -> dict:
    return {
        "system": system, "dtype": "fp16", "ms_per_step": 1.0, "s_per_image": None if not images_per_s else
        1 / images_per_s, "images_per_s": images_per_s, "time_to_ready_s": 2.5, "peak_mem_mb": 100.0,
        "energy_j_per_image": 3.0, "avg_power_w": 300.0, "psnr_db": 45.0, "max_abs_diff": 1e-3, "notes": "",
        "error": error, "extra": extra,
    }  # fmt: skip


def result(rows: list[dict]) -> dict:
    env = {"gpu": "GPU X", "torch": "t", "triton": "tr", "diffusers": "d", "git_sha": "abc", "date": "2026-11-22T00"}
    cfg = {"model": "m", "batch": 3, "sampler": "ddpm", "steps": 7, "random_weights": True,
           "quality_sampler": "ddim", "quality_steps": 5}  # fmt: skip
    return {"env": env, "config": cfg, "results": rows}


def test_table_rows_and_speedup():
    table = markdown_table(result([row("diffusers+compile", 4.0), row("engine", 10.0, kernel_cache="cold"),
                                   row("diffusers", None, error="skipped: diffusers not installed")]))  # fmt: skip
    lines = table.splitlines()
    header, body = lines[2], lines[4:]
    assert len(body) == 3
    columns = header.count("|")
    assert all(line.count("|") == columns for line in body)  # every row spans the header's columns
    assert "| 1.00 | 1.00 |" in body[0]
    assert "| 2.50 | 1.00 | 2.5 (cold cache) |" in body[1]  # same ms/step as the compile row
    assert "skipped: diffusers not installed" in body[2]
    assert "batch 3" in lines[0] and "random weights" in lines[0] and "GPU X" in lines[0]


def test_no_baseline_gives_dashes():
    body = markdown_table(result([row("engine", 10.0)])).splitlines()[4]
    assert "| 10 | — | — | 2.5 |" in body


def test_fastest_compile_row_is_the_baseline():
    """Against the fastest torch.compile configuration, whichever system it is; non-compile rows never count."""
    rows = [row("compile", 1.0), row("compile+autotune", 1.0), row("diffusers+compile", 1.0), row("eager", 1.0),
            row("engine", 1.0)]  # fmt: skip
    for r, ms in zip(rows, (3.0, 2.0, 4.0, 0.5, 1.0), strict=True):
        r["ms_per_step"] = ms
    assert fastest_compile_ms(result(rows)) == 2.0
    assert "| 2.00 | 2.5 |" in markdown_table(result(rows)).splitlines()[8]
