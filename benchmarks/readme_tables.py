"""Regenerate the README's result tables from benchmarks/results/*.json (never edit those tables by hand).

python benchmarks/readme_tables.py          # rewrite README.md between the <!-- NAME:begin/end --> markers
python benchmarks/readme_tables.py --check  # exit 1 if README.md is out of date (the test suite runs this)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROFILES = ROOT / "docs" / "profile"
sys.path.insert(0, str(ROOT / "src"))


def kernels_table() -> str:
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parts = []
    for path in sorted(RESULTS.glob("kernels-*.json")):
        parts.append(f"From `{path.relative_to(ROOT)}`: " + module.markdown_table(json.loads(path.read_text())))
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
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def bench_tables() -> str:
    from fastdiff.bench.report import markdown_table

    parts = []
    for path in sorted(RESULTS.glob("bench-*.json")):
        parts.append(f"From `{path.relative_to(ROOT)}`: " + markdown_table(json.loads(path.read_text())))
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
    return "\n".join(lines) if len(lines) > 2 else "_No `fastdiff profile` report committed yet._"


SECTIONS = {"kernels": kernels_table, "fd": fd_table, "bench": bench_tables, "profile": profile_table}


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
