"""Regenerate the result tables of the documentation from benchmarks/results/*.json (never edit them by hand).

python benchmarks/readme_tables.py          # rewrite every table between its <!-- NAME:begin/end --> markers
python benchmarks/readme_tables.py --check  # exit 1 if a document is out of date (the test suite runs this)

``DOCUMENTS`` says which tables live in which file: the README's one headline table, every result table in
docs/results.md, the kernel benchmark in docs/kernels.md. The prose around the markers is written by hand.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROFILES = ROOT / "docs" / "profile"
sys.path.insert(0, str(ROOT / "src"))


MEASURED_CODE = {
    "kernels": ("src/fastdiff/kernels",),
    "fd": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models"),
    "bench": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models",
              "src/fastdiff/bench"),
    "compile": ("src/fastdiff/models", "src/fastdiff/bench/systems.py", "src/fastdiff/devices.py",
                "benchmarks/sweep_compile.py"),
    "parity": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models"),
    "profile": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/profile",
                "src/fastdiff/bench/counts.py", "src/fastdiff/bench/roofline.py", "src/fastdiff/bench/breakdown.py"),
    "serve": ("src/fastdiff/serve", "src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels"),
    "t2i": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models",
            "src/fastdiff/pipelines", "src/fastdiff/bench/text_to_image.py"),
    "t2i-quality": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models",
                    "src/fastdiff/pipelines", "src/fastdiff/weights/fashion-mnist-t2i", "benchmarks/t2i_quality.py"),
}  # fmt: skip
"""Per table, the code its numbers depend on: a table is older than the code when these paths changed since. A
file that moved counts by its code, as if it had not moved (the diff follows renames across the whole tree)."""
MEASURED_CODE["headline"] = MEASURED_CODE["bench"]
MEASURED_CODE["ready"] = MEASURED_CODE["bench"][:-1] + ("src/fastdiff/pipelines", "benchmarks/ready.py")
MEASURED_CODE["tune"] = MEASURED_CODE["bench"][:-1] + ("src/fastdiff/pipelines", "src/fastdiff/tune.py")
MEASURED_CODE["bulk"] = MEASURED_CODE["bench"][:-1] + ("src/fastdiff/pipelines", "src/fastdiff/generate.py")


def without_docstrings(source: str) -> str:
    """The syntax tree of Python ``source`` with every bare string statement (module, class, function and attribute
    docstrings) removed, dumped as text: what runs, whatever the docstrings, comments and formatting say."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [
                    stmt for stmt in body
                    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                            and isinstance(stmt.value.value, str))
                ]  # fmt: skip
                setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@functools.cache
def tree_diff(sha: str) -> tuple[tuple[str, str | None, str | None], ...] | None:
    """Every file that differs between commit ``sha`` and the working tree, as (git's status letter and score, path
    at ``sha``, path now), renames paired up across the whole tree (a path is None where the file does not exist
    on that side); None for a commit this clone does not have."""
    diff = _git("diff", "--name-status", "-M", "--no-color", sha)
    if diff.returncode:
        return None
    entries = []
    for line in diff.stdout.splitlines():
        status, *names = line.split("\t")
        old, new = names[0], names[-1]
        entries.append((status, None if status == "A" else old, None if status == "D" else new))
    return tuple(entries)


def under(name: str | None, paths: tuple[str, ...]) -> bool:
    """Whether file ``name`` is one of ``paths`` or lies in one of them."""
    return name is not None and any(name == p or name.startswith(p.rstrip("/") + "/") for p in paths)


@functools.cache
def same_code(sha: str, old: str, new: str) -> bool:
    """Whether Python file ``old`` at commit ``sha`` and file ``new`` in the working tree hold the same code (their
    syntax trees without docstrings are equal); False for anything that is not Python on both sides."""
    if not (old.endswith(".py") and new.endswith(".py") and (ROOT / new).is_file()):
        return False
    before = _git("show", f"{sha}:{old}")
    return before.returncode == 0 and without_docstrings(before.stdout) == without_docstrings((ROOT / new).read_text())


def changed_code(sha: str, paths: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(files under ``paths`` whose code changed since ``sha``, files where only docstrings, comments, formatting or
    the file's location did), against the working tree, so regenerating before a commit gives what the committed
    tree will give (a new file counts once it is staged: git diff does not see untracked files). A file counts if it
    lies under ``paths`` now or did at ``sha``; a watched path that exists in neither is never reported. For a commit
    this clone does not have, every watched path that exists counts."""
    entries = tree_diff(sha)
    if entries is None:
        return [p for p in paths if (ROOT / p).exists()], []
    code, docs = [], []
    for status, old, new in entries:
        if not (under(old, paths) or under(new, paths)):
            continue
        name = new if under(new, paths) else old
        intact = status == "R100" or (old is not None and new is not None and same_code(sha, old, new))
        (docs if intact else code).append(name)
    return code, docs


def freshness(sha: str | None, table: str, same_content: tuple[str, ...] = ()) -> str:
    """A sentence saying whether the run's commit still has the code the table measures (per ``MEASURED_CODE``;
    docstrings, comments, formatting and file moves are not code). ``same_content``: measured paths whose bytes the
    result itself shows to be those measured (a digest it recorded), whatever their history."""
    if not sha:
        return "**The commit of this run is unknown: the table is older than the code it measures.**"
    paths = MEASURED_CODE[table]
    code, docs = changed_code(sha, tuple(p for p in paths if p not in same_content))
    if code:
        changed = [p for p in paths if any(under(f, (p,)) for f in code)]
        return f"**Older than the code it measures: {', '.join(changed)} changed since {sha}.**"
    if docs:
        aside = "docstrings, comments and moves aside"
        return f"The measured code ({', '.join(paths)}) is unchanged since {sha} ({aside})."
    return f"The measured code ({', '.join(paths)}) is unchanged since {sha}."


def is_stale(sha: str | None, table: str) -> bool:
    """Whether the code ``table`` measures changed since commit ``sha`` (see ``freshness``)."""
    return not sha or bool(changed_code(sha, MEASURED_CODE[table])[0])


def kernels_table() -> str:
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parts = []
    for path in sorted(RESULTS.glob("kernels-*.json")):
        d = json.loads(path.read_text())
        note = freshness(d["env"]["git_sha"], "kernels")
        parts.append(f"From `{path.relative_to(ROOT)}`: {module.markdown_table(d)}\n\n{note}")
    return "\n\n".join(parts)


def optional_cell(text: object, shown: bool) -> str:
    """A Markdown table cell (after its row's last "|"), or nothing when the column is not ``shown``."""
    return f" {text} |" if shown else ""


def fd_table() -> str:
    parts = []
    for path in sorted(RESULTS.glob("fd-fmnist-*.json")):
        d = json.loads(path.read_text())
        env, cfg = d["env"], d["config"]
        cached = any(r.get("cache_interval", 1) > 1 for r in d["results"])  # a step-cache column if a row caches
        cache = functools.partial(optional_cell, shown=cached)
        lines = [
            f"From `{path.relative_to(ROOT)}`: {cfg['n']} samples (seeds {cfg['seeds']}) of `{cfg['model']}` "
            f"in {cfg['dtype']} ({d['results'][0]['backend']} backend) vs the 10,000 Fashion-MNIST test images; "
            f"{env['gpu']}, torch {env['torch']}, git {env['git_sha']}, {env['date'][:10]}.",
            "",
            f"| sampler | steps |{cache('cache interval')} FD-FMNIST ↓ | seconds to sample all (prepared pipeline) "
            "| seconds to prepare |",
            f"| --- | ---: |{cache('---:')} ---: | ---: | ---: |",
        ]
        for r in d["results"]:
            lines.append(
                f"| {r['sampler']} | {r['steps']} |{cache(r.get('cache_interval', 1))} {r['fd_fmnist']:.2f} "
                f"| {r['sample_seconds']:.1f} | {r['ready_seconds']:.1f} |"
            )
        floor = d["floor_train_vs_test"]
        if floor is not None:
            lines.append(f"| 10,000 training images (the floor) | — |{cache('—')} {floor:.2f} | — | — |")
        lines += ["", freshness(env["git_sha"], "fd")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def roofline_floor_lines(result: dict) -> list[str]:
    """One line per engine row of a bench result with an op table and no fp8 ops (their % of ceiling is of the
    bf16 matmul ceiling, so a floor from it would be wrong): its step, the floor of its op graph by class, and
    half of the fastest torch.compile step of the run."""
    from fastdiff.bench.ops import roofline_floor_ms
    from fastdiff.bench.report import fastest_compile_ms

    fastest = fastest_compile_ms(result)
    lines = []
    for r in result["results"]:
        table = (r.get("extra") or {}).get("op_table")
        if r["system"] != "engine" or not table or any(op.get("fp8") for op in table["ops"]):
            continue
        floor = roofline_floor_ms(table["ops"])
        by_class = ", ".join(f"{name} {ms:.3f}" for name, ms in floor.items())
        half = f"; half of the fastest torch.compile step in this run: {fastest / 2:.3f} ms" if fastest else ""
        lines.append(
            f"Engine {r['dtype']}: {r['ms_per_step']:.3f} ms per step; every op at the ceiling that bounds it on the "
            f"roofline (the floor of this op graph): {sum(floor.values()):.3f} ms ({by_class}){half}."
        )
    return lines


def bench_tables() -> str:
    from fastdiff.bench.report import markdown_table

    parts = []
    for path in sorted(RESULTS.glob("bench-*.json")):
        d = json.loads(path.read_text())
        floors = "".join(f"\n\n{line}" for line in roofline_floor_lines(d))
        parts.append(
            f"From `{path.relative_to(ROOT)}`: {markdown_table(d)}{floors}\n\n{freshness(d['env']['git_sha'], 'bench')}"
        )
    return "\n\n".join(parts) or "_No `fastdiff bench` result committed yet._"


def compile_table() -> str:
    """One table of the torch.compile sweeps (benchmarks/sweep_compile.py): a row per configuration, a column per
    sweep file (model, batch), ms per forward with the compile time; the fastest of each column in bold."""
    sweeps = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("sweep-compile-*.json"))]
    if not sweeps:
        return "_No torch.compile sweep committed yet._"
    sweeps.sort(key=lambda d: (d["model"], d["batch"]))
    names = list(dict.fromkeys(r["config"] for d in sweeps for r in d["rows"]))
    from fastdiff.bench.env import gpu_slug

    head = (
        "| configuration | "
        + " | ".join(f"{d['model']} batch {d['batch']} ({gpu_slug(d['env']['gpu'])})" for d in sweeps)
        + " |"
    )
    lines = [
        "ms per U-Net forward, fp16 (compile time in parentheses; fastest in bold; — not run):",
        "",
        head,
        "| --- |" + " ---: |" * len(sweeps),
    ]
    for name in names:
        cells = []
        for d in sweeps:
            row = next((r for r in d["rows"] if r["config"] == name), None)
            if row is None:
                cells.append("—")
            elif row.get("error"):
                cells.append("failed")
            else:
                best = min(r["ms_per_forward"] for r in d["rows"] if r.get("ms_per_forward"))
                cell = f"{row['ms_per_forward']:.3f}"
                cells.append(f"**{cell}**" if row["ms_per_forward"] == best else cell)
                cells[-1] += f" ({row['compile_s']:.0f} s)"
        notes = next((r["notes"] for d in sweeps for r in d["rows"] if r["config"] == name and "notes" in r), "")
        lines.append(f"| {name} ({notes}) | " + " | ".join(cells) + " |")
    for d in sweeps:
        env = d["env"]
        lines.append(
            f"\n{d['model']} batch {d['batch']}: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, git "
            f"{env['git_sha']}, {env['date'][:10]}, median of {d.get('repeats', 5)} timed runs of {d['calls']} "
            "back-to-back forwards "
            f"(`benchmarks/results/sweep-compile-{d['model']}-b{d['batch']}-*.json`). "
            + freshness(env["git_sha"], "compile")
        )
    return "\n".join(lines)


def profile_table() -> str:
    """One row per (report, backend) of docs/profile/*/report.json: time split, memory, energy, load."""
    classes = ("convolution", "normalisation", "attention", "elementwise", "sampler", "other")
    lines = [
        "| report | device | backend | ms/step | conv | norm | attn | elementwise | sampler | other | idle "
        "| kernels/step | peak MiB | J/image | load→first step ms (avg: sync / async / early start) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def num(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    notes = []
    for path in sorted(PROFILES.glob("*/report.json")):
        d = json.loads(path.read_text())
        if d.get("schema") == "fastdiff.profile.text_to_image/1":
            continue  # a text-to-image report has its own layout (its report.md)
        modes = d["load_to_first_step"]["modes"]
        load = " / ".join(num(m.get("avg_ms"), ".0f") for m in modes.values())
        link = f"[{path.parent.name}]({link_to('profile', path.parent / 'report.md')})"
        for name, b in d["backends"].items():
            bd = b["breakdown"]
            e2e = bd["end_to_end_ms"]
            pct = {k: 100 * v / e2e for k, v in bd["per_class_ms"].items()}
            pct["other"] += pct.pop("transfer")
            peak = b["memory"].get("peak_allocated_bytes")
            cells = [link, d["env"]["gpu"], name, f"{e2e:.3f}", *(f"{pct[k]:.0f}%" for k in classes),
                     f"{100 * bd['idle_ms'] / e2e:.0f}%", num(bd.get("kernels_per_step"), ".0f"),
                     num(None if peak is None else peak / 2**20, ".0f"), num(b["energy"].get("j_per_image"), ".3g"),
                     load]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        notes.append(f"{path.parent.name}: {freshness(d['env']['git_sha'], 'profile')}")
    if len(lines) == 2:
        return "_No `fastdiff profile` report committed yet._"
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {note}" for note in notes)


def parity_table() -> str:
    """Paired PSNR of fastdiff's loops vs diffusers' default loops (benchmarks/sampler_parity.py)."""
    parts = []
    for path in sorted(RESULTS.glob("sampler-parity-*.json")):
        d = json.loads(path.read_text())
        env = d["env"]
        lines = [
            f"From `{path.relative_to(ROOT)}`: {d['config']['batch']} images per case, the same unit-variance x_T; "
            f"reference: {d['config']['reference']}. {env['gpu']}, torch {env['torch']}, diffusers "
            f"{env.get('diffusers')}, git {env['git_sha']}, {env['date'][:10]}.",
            "",
            "| model | sampler | steps | fastdiff eager fp32 | diffusers with TF32 convs (the floor) | engine fp16 "
            "| engine bf16 |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        cells: dict[tuple, dict] = {}
        for r in d["results"]:
            cells.setdefault((r["model"], r["sampler"], r["steps"]), {})[(r["backend"], r["dtype"])] = r
        for (model, sampler, steps), by in cells.items():
            columns = [("eager", "fp32"), ("diffusers (TF32 convs)", "fp32"), ("engine", "fp16"), ("engine", "bf16")]
            values = [f"{by[c]['psnr_db_vs_diffusers_fp32']:.1f} dB" if c in by else "–" for c in columns]
            lines.append(f"| {model} | {sampler} | {steps} | " + " | ".join(values) + " |")
        lines += ["", freshness(env["git_sha"], "parity")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "_No sampler parity result committed yet._"


def serve_table() -> str:
    """`fastdiff loadtest` runs against `fastdiff serve` (scripts/gpu_serve_loadtest.sh; for text-to-image also the
    diffusers reference server and the issue's targets, scripts/gpu_loadtest_t2i.sh)."""
    parts = []
    for path in sorted(RESULTS.glob("serve-loadtest-*.json")):
        d = json.loads(path.read_text())
        env, cfg, same = d["env"], d["server"], d["batched_vs_solo"]
        identical = same.get("note", "not checked") if same.get("byte_identical") is None else same["byte_identical"]
        lines = [
            f"From `{path.relative_to(ROOT)}`: `{cfg['model']}` ({cfg['dtype']} on {cfg['device']}, {cfg['sampler']} "
            f"{cfg['steps']} steps, max batch {cfg['max_batch']}, batches padded to {cfg['batch_buckets']}, "
            f"max wait {cfg['max_wait_ms']} ms, queue {cfg['queue_size']}); {env['gpu']}, torch {env['torch']}, git "
            f"{env['git_sha']}, {env['date'][:10]}. Batched vs solo answers byte-identical: {identical} "
            f"({same['requests']} requests of {same['images_per_request']} images).",
            "",
            "| system | run | clients | requests | images/s | p50 ms | p95 ms | p99 ms | answered | 429 | errors |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        systems = [("fastdiff serve", d["loadtests"])]
        if "reference" in d:
            systems.append((d["reference"]["server"]["system"], d["reference"]["loadtests"]))
        for system, runs in systems:
            for name, s in runs.items():
                lat = s.get("latency_ms") or {}
                lines.append(
                    f"| {system} | {name} | {s['concurrency']} | {s['requests']} "
                    f"| {_num(s.get('images_per_s'), '.1f')} "
                    f"| {_num(lat.get('p50'), '.0f')} | {_num(lat.get('p95'), '.0f')} | {_num(lat.get('p99'), '.0f')} "
                    f"| {s['ok']} | {s['rejected_429']} | {s['errors']} |"
                )
        base = d.get("baseline_sequential_batch1")
        if base:
            lat = base.get("latency_ms") or {}
            lines.append(
                f"| sequential batch-1 sampling, no server | | 1 | {base['images']} "
                f"| {_num(base['images_per_s'], '.1f')} "
                f"| {_num(lat.get('p50'), '.0f')} | {_num(lat.get('p95'), '.0f')} | {_num(lat.get('p99'), '.0f')} "
                "| – | – | – |"
            )
        targets = d.get("targets") or {}
        if targets:
            lines += ["", "| target | value | wanted | met |", "| --- | --- | --- | --- |"]
            for name, t in targets.items():
                value = t.get("value", "–")
                lines.append(f"| {name} | {_num(value, '.2f') if isinstance(value, float) else value} "
                             f"| {t.get('target', '–')} | {t.get('met')} |")  # fmt: skip
        lines += ["", freshness(env["git_sha"], "serve")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "_No load test committed yet._"


def machine(env: dict) -> str:
    """The GPU's name, or the CPU's for a CPU run (whose ``gpu`` field is "cpu")."""
    return env["gpu"] if env["gpu"] != "cpu" else f"CPU ({env['cpu']}, no GPU)"


def _ratio(base: dict, row: dict, key: str) -> str:
    """base[key] / row[key] (a speed-up over ``base`` for times), or a dash."""
    return f"{base[key] / row[key]:.2f}" if base.get(key) and row.get(key) else "—"


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def t2i_tables() -> str:
    """``fastdiff bench --model sd15``: one row per system, then where the engine's U-Net step goes."""
    parts = []
    for path in sorted(RESULTS.glob("t2i-bench-*.json")):
        d = json.loads(path.read_text())
        env, cfg = d["env"], d["config"]
        rows = {f"{r['system']}-{r['dtype']}": r for r in d["results"]}
        base = rows.get("diffusers+compile-fp16") or rows.get("diffusers+compile-fp32", {})  # fp32 on a CPU
        lines = [
            f"From `{path.relative_to(ROOT)}`: **{cfg['model']}** "
            f"({'random weights' if cfg['random_weights'] else 'trained weights'}), {cfg['batch']} image(s) of "
            f"{cfg['width']}x{cfg['height']}, {cfg['sampler']} {cfg['steps']} steps, guidance {cfg['guidance']} "
            f"(U-Net batch {(2 if cfg['guidance'] > 1 else 1) * cfg['batch']}) — {machine(env)}, torch {env['torch']}, "
            f"triton {env['triton']}, "
            f"diffusers {env['diffusers']}, git {env['git_sha']}, {env['date'][:10]}.",
            "",
            "| system | dtype | U-Net step ms | × diffusers+compile | end to end ms | × diffusers+compile | ready s "
            "| peak MiB (ready / sampling) | weights MiB | PSNR vs diffusers fp32 dB |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]

        for r in d["results"]:
            if r["error"]:
                lines.append(f"| {r['system']} | {r['dtype']} | failed: {r['error']} | | | | | | | |")
                continue
            lines.append(
                f"| {r['system']} | {r['dtype']} | {r['unet_step_ms']:.2f} | {_ratio(base, r, 'unet_step_ms')} "
                f"| {r['end_to_end_ms']:.1f} | {_ratio(base, r, 'end_to_end_ms')} | {r['time_to_ready_s']:.1f} "
                f"| {_num(r['peak_ready_mib'], '.0f')} / {_num(r['peak_sampling_mib'], '.0f')} "
                f"| {r['weights_mib']:.0f} "
                f"| {_num(r['psnr_vs_diffusers_fp32_db'], '.1f')} |"
            )
        engine = rows.get("engine-fp16", {}).get("extra", {})
        table = engine.get("op_table")
        ops = table["ops"] if table else engine.get("unet_ops")  # results before the op table: the U-Net's ops only
        if ops:
            by_kind: dict[tuple[str, str], list[float]] = {}
            for op in ops:
                by_kind.setdefault((op["kind"], op["impl"]), []).append(op["us"])
            total = sum(sum(v) for v in by_kind.values())
            lines += [
                "",
                f"Engine fp16 step, op by op ({engine['unet_ops_per_step']} U-Net ops per step, each timed in a "
                f"CUDA graph of repeated launches; sum {total / 1e3:.2f} ms); activations "
                f"{engine['unet_arena_mib']:.0f} MiB (U-Net arena) and {engine['vae_decoder_arena_mib']:.0f} MiB "
                f"(VAE decode arena) next to {engine['unet_weights_mib']:.0f} + "
                f"{engine['vae_decoder_weights_mib']:.0f} MiB of weights:",
                "",
                "| op kind | implementation | ops | ms | share of the step |",
                "| --- | --- | ---: | ---: | ---: |",
            ]
            for (kind, impl), times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
                lines.append(
                    f"| {kind} | {impl} | {len(times)} | {sum(times) / 1e3:.3f} | {100 * sum(times) / total:.1f}% |"
                )
        if table:
            step = rows["engine-fp16"]["unet_step_ms"]
            floor = table["floor_ms_per_step"]
            by_class = ", ".join(f"{name} {c['floor_ms']:.3f}" for name, c in table["classes"].items())
            lines += [
                "",
                f"Every op at the ceiling that bounds it on the roofline (the floor of this op graph; ceilings "
                f"{d['ceilings']['tflops']:.0f} TFLOP/s and {d['ceilings']['gbps']:.0f} GB/s measured in the run): "
                f"{floor:.3f} ms ({by_class}); the engine fp16 step ({step:.3f} ms) is at {100 * floor / step:.0f} % "
                "of that floor's speed.",
            ]
        lines += ["", freshness(env["git_sha"], "t2i")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "_No text-to-image bench committed yet._"


def t2i_model_table() -> str:
    """The bundled text-to-image model's training runs and the quality its U-Net stage measured."""
    docs = ROOT / "docs" / "fashion-mnist-t2i"
    vae, unet = (json.loads((docs / f"{stage}-stage.json").read_text()) for stage in ("vae", "unet"))
    v, u = vae["summary"], unet["summary"]
    ev = u["eval"]
    compiled = ", compiled" if u["settings"].get("compile") else ""
    runs = f", {len(unet['runs'])} runs: paused and resumed" if len(unet.get("runs", [])) > 1 else ""
    lines = [
        f"Training ({v['env']['gpu']}, torch {v['env']['torch']}; records in `docs/fashion-mnist-t2i/`): VAE "
        f"{v['params'] / 1e6:.1f} M parameters, {v['step']} steps of {v['settings']['batch_size']} in "
        f"{v['train_seconds']:.0f} s, {'x'.join(map(str, v['latent_shape'][1:] + v['latent_shape'][:1]))} latents, "
        f"test-set reconstruction PSNR {v['psnr_db']:.1f} dB, reconstruction FD-FMNIST "
        f"{v.get('fd_fmnist_reconstructions', float('nan')):.2f} (training images), scaling factor "
        f"{v['scaling_factor']:.4f} (git {v['env']['git_sha']}, {v['env']['date'][:10]}); U-Net "
        f"{u['params']['unet'] / 1e6:.1f} M + text encoder {u['params']['text_encoder'] / 1e6:.2f} M parameters on "
        f"that VAE's latents, {u['step']} steps of {u['settings']['batch_size']} at learning rate "
        f"{u['settings']['lr']:g}{compiled} in {u['train_seconds']:.0f} s ({u['stopped']}; git {u['env']['git_sha']}, "
        f"{u['env']['date'][:10]}{runs}); {u['model_bytes'] / 1e6:.1f} MB on disk.",
    ]
    system = ev.get("system", "fp32, eager")
    per_class = ev["per_class"]
    bias = " (1,000 images: biased high next to a 10,000-image FD)" if 10 * per_class < 10_000 else ""
    lines += [
        "",
        f"Quality of the trained model ({system}; {ev['sampler']} {ev['steps']} steps, {per_class:,} images "
        "per class prompt): the share the bundled Fashion-MNIST classifier assigns to the prompt's class, and "
        f"FD-FMNIST against the test set{bias}.",
        "",
        "| guidance | conditional accuracy | FD-FMNIST ↓ |",
        "| ---: | ---: | ---: |",
    ]
    for guidance, rec in ev["guidance"].items():
        lines.append(f"| {guidance} | {100 * rec['accuracy']:.1f}% | {rec.get('fd_fmnist', float('nan')):.1f} |")
    return "\n".join(lines)


def bundled_weights_measured(result: dict) -> tuple[str, ...]:
    """("src/fastdiff/weights/fashion-mnist-t2i",) when a quality result's ``weights_sha256`` is the digest of the
    bundled model's weight files now (they are the weights it measured, wherever it read them), else ()."""
    from fastdiff.generate import hash_model_files

    folder = "src/fastdiff/weights/fashion-mnist-t2i"
    now = hash_model_files(ROOT / folder, (".safetensors",))
    return (folder,) if result.get("weights_sha256") == now else ()


def t2i_quality_targets(rows: list[dict]) -> list[str]:
    """The bundled text-to-image model's quality targets (20 steps) against one system's rows: accuracy and FD at
    guidance 3 with every step guided, the lowest FD at guidance 3 with a guidance interval, and the lowest FD at
    >= 95 % accuracy over every configuration."""
    out = []
    at3 = [r for r in rows if r["guidance"] == 3 and r["steps"] == 20 and "guidance_interval" not in r]
    if at3:
        acc = [100 * r["accuracy"] for r in at3]
        fd = [r["fd_fmnist"] for r in at3]
        out.append(
            f"Guidance 3, 20 steps, every step guided: accuracy {min(acc):.1f}–{max(acc):.1f}% (target ≥ 98%: "
            f"{'met' if min(acc) >= 98 else 'missed'}), FD-FMNIST {min(fd):.1f}–{max(fd):.1f} (target ≤ 10: "
            f"{'met' if max(fd) <= 10 else 'missed'})."
        )
    spans = [r for r in rows if r["guidance"] == 3 and r["steps"] == 20 and "guidance_interval" in r]
    if spans:
        best = min(spans, key=lambda r: r["fd_fmnist"])
        out.append(
            f"Guidance 3 in an interval: lowest FD-FMNIST {best['fd_fmnist']:.1f} ({best['sampler']}, steps "
            f"{guided_steps(best)} guided) at accuracy {100 * best['accuracy']:.1f}%."
        )
    accurate = [r for r in rows if r["steps"] == 20 and r["accuracy"] >= 0.95]
    if accurate:
        best = min(accurate, key=lambda r: r["fd_fmnist"])
        out.append(
            f"Lowest FD-FMNIST at ≥ 95% accuracy in 20 steps: {best['fd_fmnist']:.1f} ({best['sampler']}, guidance "
            f"{best['guidance']:g}, steps {guided_steps(best)} guided, accuracy {100 * best['accuracy']:.1f}%; "
            f"target ≤ 5: {'met' if best['fd_fmnist'] <= 5 else 'missed'})."
        )
    return [" ".join(out)] if out else []


def guided_steps(row: dict) -> str:
    """A quality row's guidance interval as the table shows it: "all" or "START–STOP" (fractions of the steps)."""
    span = row.get("guidance_interval")
    return "all" if span is None else f"{span[0]:g}–{span[1]:g}"


def t2i_quality_tables() -> str:
    """``benchmarks/t2i_quality.py``: conditional accuracy / FD-FMNIST per sampler, steps, guided steps (the guidance
    interval) and guidance, one table per system (backend and dtype), with the issue's targets."""
    parts = []
    for path in sorted(RESULTS.glob("t2i-quality-*.json")):
        d = json.loads(path.read_text())
        env, cfg = d["env"], d["config"]
        guidances = sorted({r["guidance"] for r in d["results"]})
        images = sorted({r["images"] for r in d["results"]})
        where = f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, git {env['git_sha']}, {env['date'][:10]}"
        lines = [f"From `{path.relative_to(ROOT)}`: **{cfg['model']}**"]
        if d.get("weights"):
            lines[0] += f" ({d['weights']})"
        if images:
            lines[0] += (
                f", {'/'.join(f'{n:,}' for n in images)} images per configuration ({cfg['per_class']:,} per class "
                "prompt, the same seeds in every configuration); each cell is conditional accuracy / FD-FMNIST "
                f"against the 10,000 test images — {where}."
            )
        if d.get("floor"):
            f = d["floor"]
            lines[0] += (
                f"{'' if images else f' — {where}.'} Floors, which no sampler can beat: {f['images']:,} real "
                f"training images are at FD-FMNIST {f['fd_fmnist_real_train']:.2f} from the test set and their VAE "
                f"reconstructions at {f['fd_fmnist_vae_reconstructions']:.2f}; the classifier labels "
                f"{100 * f['classifier_accuracy_real_test']:.1f}% of the real test images correctly"
                + (f" (measured in {f['measured_in']})." if f.get("measured_in") else ".")
            )
        for system in dict.fromkeys(r["system"] for r in d["results"]):
            rows = [r for r in d["results"] if r["system"] == system]
            lines += [
                "",
                f"**{system}**",
                "",
                "| sampler | steps | guided steps | " + " | ".join(f"guidance {g:g}" for g in guidances) + " |",
                "| --- | ---: | --- |" + " ---: |" * len(guidances),
            ]
            for sampler, steps, span in dict.fromkeys((r["sampler"], r["steps"], guided_steps(r)) for r in rows):
                cells = {
                    r["guidance"]: r
                    for r in rows
                    if (r["sampler"], r["steps"], guided_steps(r)) == (sampler, steps, span)
                }
                lines.append(
                    f"| {sampler} | {steps} | {span} | "
                    + " | ".join(
                        f"{100 * cells[g]['accuracy']:.1f}% / {cells[g]['fd_fmnist']:.1f}" if g in cells else "—"
                        for g in guidances
                    )
                    + " |"
                )
            lines += ["", *t2i_quality_targets(rows)]
        lines += ["", freshness(env["git_sha"], "t2i-quality", bundled_weights_measured(d))]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "_No text-to-image quality grid committed yet._"


def headline_table() -> str:
    """The README's one table: per ``fastdiff bench`` run, the engine's step against the fastest torch.compile
    configuration and diffusers + torch.compile of the same run."""
    from fastdiff.bench.report import is_compiled

    lines = [
        "| model | batch | GPU | engine fp16 ms/step | engine fp8 ms/step | fastest torch.compile ms/step "
        "| diffusers + torch.compile ms/step | engine fp16 × fastest compile | engine fp16 × diffusers + compile "
        "| run |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    stale = []
    for path in sorted(RESULTS.glob("bench-*.json")):
        d = json.loads(path.read_text())
        cfg, env = d["config"], d["env"]
        ok = [r for r in d["results"] if not r.get("error") and r.get("ms_per_step")]
        rows = {f"{r['system']}-{r['dtype']}": r for r in ok}
        engine, fp8, diffusers = (rows.get(k) for k in ("engine-fp16", "engine-fp8", "diffusers+compile-fp16"))
        compiled = [r for r in ok if is_compiled(r["system"])]
        if engine is None or not compiled:
            continue
        fastest = min(compiled, key=lambda r: r["ms_per_step"])
        ms = engine["ms_per_step"]
        cells = [
            cfg["model"], str(cfg["batch"]), env["gpu"], f"{ms:.3f}",
            _num(fp8["ms_per_step"] if fp8 else None, ".3f"),
            f"{fastest['ms_per_step']:.3f} (`{fastest['system']}`)",
            _num(diffusers["ms_per_step"] if diffusers else None, ".3f"),
            f"**{fastest['ms_per_step'] / ms:.2f}×**",
            "—" if diffusers is None else f"{diffusers['ms_per_step'] / ms:.2f}×",
            f"git {env['git_sha']}, {env['date'][:10]}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        if is_stale(env["git_sha"], "headline"):
            stale.append(env["git_sha"])
    if len(lines) == 2:
        return "_No `fastdiff bench` result committed yet._"
    if stale:
        results = link_to("headline", ROOT / "docs" / "results.md")
        lines += [
            "",
            f"The engine, kernel, model, sampler or bench code has changed since run(s) {', '.join(stale)}: "
            f"[{results}]({results}#end-to-end-fastdiff-bench) says what.",
        ]
    return "\n".join(lines)


def table_with_notes(lines: list[str], shas: list[str], table: str, empty: str) -> str:
    """The table ``lines`` and, under it, one ``freshness`` line per run commit in ``shas``; ``empty`` without runs."""
    if not shas:
        return empty
    return "\n".join(lines + [""] + sorted({freshness(sha, table) for sha in shas}))


def ready_table() -> str:
    """``benchmarks/ready.py``: time to ready and first image in fresh processes, and bytes across them (the engine,
    or ``--system compile``: the eager pipeline with its U-Net under torch.compile)."""
    aligns = ["---", "---", "---:", "---", "---", "---", *["---:"] * 6, "---", "---:", "---", "---:", "---"]
    lines = [
        "| run | model | batch | system | GPU | caches | runs | import s | load s | first forward s "
        "| plan or tuning s | capture s | to first image s (best / mean / worst) | ms/step | plan | images differing "
        "| git |",
        "| " + " | ".join(aligns) + " |",
    ]

    def mean(summary: dict, phase: str, spec: str) -> str:
        value = summary.get(phase, {}).get("mean")
        return "–" if value is None else format(value, spec)

    shas = []
    for path in sorted(RESULTS.glob("ready-*.json")):
        d = json.loads(path.read_text())
        env, cfg, diff = d["env"], d["config"], d["images_differing_between_processes"]
        shas.append(env["git_sha"])
        for mode, block in d["modes"].items():
            s = block["summary"]
            first = s["to_first_image_s"]
            lines.append(
                f"| `{path.stem}` | {cfg['model']} | {cfg['batch']} | {cfg.get('system', 'engine')} | {machine(env)} "
                f"| {mode} | {s['runs']} | {mean(s, 'import_s', '.1f')} | {mean(s, 'load_s', '.1f')} "
                f"| {mean(s, 'first_forward_s', '.1f')} | {mean(s, 'plan_or_tune_s', '.2f')} "
                f"| {mean(s, 'capture_s', '.2f')} | {first['best']:.1f} / {first['mean']:.1f} / {first['worst']:.1f} "
                f"| {mean(s, 'step_ms', '.3f')} | {', '.join(s.get('plan_sources', [])) or '–'} "
                f"| {diff['differing']} of {diff['images']} ({diff['processes']} processes) | {env['git_sha']} |"
            )
    return table_with_notes(lines, shas, "ready", "_No ready-time run committed yet._")


def tune_table() -> str:
    """``benchmarks/tune_presets.py``: ``fastdiff tune`` per preset from empty caches (the cold, no-plan time), or
    with the jobs sharing caches in order (``--shared-caches``: a plan file in fewer minutes, not a cold start)."""
    lines = [
        "| run | model | batch | guidance | GPU | compiled on | caches | wall s | status | git |",
        "| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- | --- |",
    ]
    shas = []
    for path in sorted(RESULTS.glob("tune-presets-*.json")):
        d = json.loads(path.read_text())
        env = d["env"]
        shas.append(env["git_sha"])
        caches = "shared, in order" if d.get("shared_caches") else "empty"
        for job in d["jobs"]:
            status = job.get("skipped") or ("ok" if job.get("rc") == 0 else f"failed ({job.get('rc')})")
            wall = f"{job['wall_s']:.0f}" if "wall_s" in job else "–"
            if "compile_workers" in job:  # forked worker processes (engine/compile_pool.py)
                workers = job["compile_workers"]
                threads = "16 processes" if workers == "default" else f"{workers} processes"
            else:  # runs before git 708d16e: host threads
                threads = job.get("compile_threads", "–")
                threads = "16 threads" if threads == "default" else f"{threads} threads"
            lines.append(
                f"| `{path.stem}` | {job['model']} | {job['batch']} | {job.get('guidance', '–')} | {machine(env)} "
                f"| {threads} | {caches} | {wall} | {status} | {env['git_sha'][:7]} |"
            )
    return table_with_notes(lines, shas, "tune", "_No tuning run committed yet._")


def bulk_table() -> str:
    """``scripts/gpu_generate.sh``: ``fastdiff generate`` on one GPU and under torchrun on two, the sampler alone, and
    whether the two folders hold the same bytes."""
    lines = [
        "| run | GPUs | images | 1 GPU img/s | 2 GPUs img/s | speed-up | sampler alone img/s | generate / sampler "
        "| files differing 1 vs 2 GPUs | git |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    shas = []
    for path in sorted(RESULTS.glob("generate-*.json")):
        d = json.loads(path.read_text())
        shas.append(d["env"]["git_sha"])
        sampler = d.get("sampler_only_images_per_s_1gpu")
        ratio = d.get("generate_vs_sampler_1gpu")
        lines.append(
            f"| `{path.stem}` | {len(d['gpus'])}x {d['gpus'][0]} | {d['files_compared']} "
            f"| {d['images_per_s_1gpu']:.0f} | {d['images_per_s_2gpu']:.0f} | {d['speedup']:.2f}x "
            f"| {'–' if sampler is None else f'{sampler:.0f}'} | {'–' if ratio is None else f'{ratio:.2f}'} "
            f"| {d['files_differing']} of {d['files_compared']} | {d['env']['git_sha'][:7]} |"
        )
    return table_with_notes(lines, shas, "bulk", "_No bulk generation run committed yet._")


SECTIONS: dict[str, Callable[[], str]] = {
    "headline": headline_table,
    "kernels": kernels_table,
    "fd": fd_table,
    "parity": parity_table,
    "bench": bench_tables,
    "compile": compile_table,
    "profile": profile_table,
    "serve": serve_table,
    "t2i": t2i_tables,
    "t2i-model": t2i_model_table,
    "t2i-quality": t2i_quality_tables,
    "ready": ready_table,
    "tune": tune_table,
    "bulk": bulk_table,
}
"""Each generated table by its marker name."""

DOCUMENTS = {
    "README.md": ("headline",),
    "docs/results.md": (
        "t2i-model",
        "t2i-quality",
        "parity",
        "fd",
        "compile",
        "bench",
        "ready",
        "tune",
        "bulk",
        "t2i",
        "profile",
        "serve",
    ),
    "docs/kernels.md": ("kernels",),
}
"""Which tables each document holds (every table in exactly one), by its path from the repository root."""


def link_to(section: str, target: Path) -> str:
    """The relative link from the document that holds ``section`` to file ``target``."""
    document = next(ROOT / doc for doc, names in DOCUMENTS.items() if section in names)
    return Path(os.path.relpath(target, document.parent)).as_posix()


def render(text: str, names: tuple[str, ...], document: str) -> str:
    """``text`` (the contents of ``document``) with the tables ``names`` regenerated between their markers."""
    for name in names:
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if text.count(begin) != 1 or text.count(end) != 1:
            raise SystemExit(f"{document} needs the markers {begin} ... {end} once each")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{SECTIONS[name]()}\n{end}{tail}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every document is up to date")
    args = parser.parse_args()
    stale = []
    for document, names in DOCUMENTS.items():
        path = ROOT / document
        current = path.read_text()
        fresh = render(current, names, document)
        if fresh == current:
            continue
        if args.check:
            stale.append(document)
        else:
            path.write_text(fresh)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python benchmarks/readme_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
