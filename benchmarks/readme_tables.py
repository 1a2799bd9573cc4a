"""Regenerate the README's result tables from benchmarks/results/*.json (never edit those tables by hand).

python benchmarks/readme_tables.py          # rewrite README.md between the <!-- NAME:begin/end --> markers
python benchmarks/readme_tables.py --check  # exit 1 if README.md is out of date (the test suite runs this)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
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
    "parity": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/models"),
    "profile": ("src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels", "src/fastdiff/profile"),
    "serve": ("src/fastdiff/serve", "src/fastdiff/samplers", "src/fastdiff/engine", "src/fastdiff/kernels"),
}  # fmt: skip
"""Per table, the code its numbers depend on: a table is older than the code when these paths changed since."""


def freshness(sha: str | None, table: str) -> str:
    """A sentence saying whether the run's commit still has the code the table measures (per ``MEASURED_CODE``)."""
    if not sha:
        return "**The commit of this run is unknown: the table is older than the code it measures.**"
    paths = MEASURED_CODE[table]
    # against the working tree, so regenerating before a commit gives what the committed tree will give
    changed = subprocess.run(["git", "diff", "--quiet", sha, "--", *paths], cwd=ROOT).returncode
    if changed:
        return f"**Older than the code it measures: {', '.join(paths)} changed since {sha}.**"
    return f"The measured code ({', '.join(paths)}) is unchanged since {sha}."


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


def fd_table() -> str:
    parts = []
    for path in sorted(RESULTS.glob("fd-fmnist-*.json")):
        d = json.loads(path.read_text())
        env, cfg = d["env"], d["config"]
        lines = [
            f"From `{path.relative_to(ROOT)}`: {cfg['n']} samples (seeds {cfg['seeds']}) of `{cfg['model']}` "
            f"in {cfg['dtype']} ({d['results'][0]['backend']} backend) vs the 10,000 Fashion-MNIST test images; "
            f"{env['gpu']}, torch {env['torch']}, git {env['git_sha']}, {env['date'][:10]}.",
            "",
            "| sampler | steps | FD-FMNIST ↓ | seconds to sample all (prepared pipeline) | seconds to prepare |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in d["results"]:
            lines.append(
                f"| {r['sampler']} | {r['steps']} | {r['fd_fmnist']:.2f} | {r['sample_seconds']:.1f} "
                f"| {r['ready_seconds']:.1f} |"
            )
        lines.append(f"| 10,000 training images (the floor) | — | {d['floor_train_vs_test']:.2f} | — | — |")
        lines += ["", freshness(env["git_sha"], "fd")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def bench_tables() -> str:
    from fastdiff.bench.report import markdown_table

    parts = []
    for path in sorted(RESULTS.glob("bench-*.json")):
        d = json.loads(path.read_text())
        parts.append(
            f"From `{path.relative_to(ROOT)}`: {markdown_table(d)}\n\n{freshness(d['env']['git_sha'], 'bench')}"
        )
    return "\n\n".join(parts) or "_No `fastdiff bench` result committed yet._"


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
        modes = d["load_to_first_step"]["modes"]
        load = " / ".join(num(m.get("avg_ms"), ".0f") for m in modes.values())
        link = f"[{path.parent.name}]({path.parent.relative_to(ROOT)}/report.md)"
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
    """`fastdiff loadtest` runs against `fastdiff serve` (scripts/gpu_serve_loadtest.sh)."""
    parts = []
    for path in sorted(RESULTS.glob("serve-loadtest-*.json")):
        d = json.loads(path.read_text())
        env, cfg, same = d["env"], d["server"], d["batched_vs_solo"]
        lines = [
            f"From `{path.relative_to(ROOT)}`: `{cfg['model']}` ({cfg['dtype']} on {cfg['device']}, {cfg['sampler']} "
            f"{cfg['steps']} steps, max batch {cfg['max_batch']}, batches padded to {cfg['batch_buckets']}, "
            f"max wait {cfg['max_wait_ms']} ms, queue {cfg['queue_size']}); {env['gpu']}, torch {env['torch']}, git "
            f"{env['git_sha']}, {env['date'][:10]}. Batched vs solo answers byte-identical: {same['byte_identical']} "
            f"({same['requests']} requests of {same['images_per_request']} images).",
            "",
            "| run | clients | requests | images/s | p50 ms | p95 ms | p99 ms | answered | 429 | errors |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, s in d["loadtests"].items():
            lat = s["latency_ms"]
            lines.append(
                f"| {name} | {s['concurrency']} | {s['requests']} | {s['images_per_s']:.1f} | {lat['p50']:.0f} "
                f"| {lat['p95']:.0f} | {lat['p99']:.0f} | {s['ok']} | {s['rejected_429']} | {s['errors']} |"
            )
        base = d["baseline_sequential_batch1"]
        lines.append(
            f"| sequential batch-1 sampling, no server | 1 | {base['images']} | {base['images_per_s']:.1f} "
            f"| {base['latency_ms']['p50']:.0f} | {base['latency_ms']['p95']:.0f} | {base['latency_ms']['p99']:.0f} "
            "| – | – | – |"
        )
        lines += ["", freshness(env["git_sha"], "serve")]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "_No load test committed yet._"


SECTIONS = {
    "kernels": kernels_table,
    "fd": fd_table,
    "parity": parity_table,
    "bench": bench_tables,
    "profile": profile_table,
    "serve": serve_table,
}


def render(readme: str) -> str:
    for name, make in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in readme or end not in readme:
            raise SystemExit(f"README.md lacks the markers {begin} ... {end}")
        head, rest = readme.split(begin, 1)
        _, tail = rest.split(end, 1)
        readme = f"{head}{begin}\n{make()}\n{end}{tail}"
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args()
    path = ROOT / "README.md"
    current = path.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md tables are out of date: run python benchmarks/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
