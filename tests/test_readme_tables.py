"""The documentation's result tables (README.md, docs/results.md, docs/kernels.md) are generated from
benchmarks/results/*.json and must be up to date."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastdiff.bench.ops import roofline_floor_ms

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_are_generated_from_results():
    """``--check`` regenerates every table of every document in memory and compares."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_tables.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + sorted(
    (ROOT / "docs" / "profile").glob("*/report.json")
)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_names_a_commit_of_this_history(path):
    if _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    sha = json.loads(path.read_text())["env"].get("git_sha")
    assert sha, f"{path} names no commit"
    assert _git("merge-base", "--is-ancestor", sha, "HEAD").returncode == 0, f"{sha} is not an ancestor of HEAD"


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _op(cls: str, us: float | None, pct: float | None, fp8: bool = False) -> dict:
    return {"class": cls, "us": us, "pct_of_ceiling": pct, "fp8": fp8}


def test_roofline_floor_counts_each_op_at_its_bounding_ceiling():
    """A compute-bound conv at 50 % of the ceiling (100 us -> 50), one past it (an Upsample2D conv counted as the
    upsampled conv: its own 30 us), a memory-bound norm at 25 % (40 us -> 10) and a fused op (no time: 0)."""
    ops = [_op("convolution", 100.0, 50.0), _op("convolution", 30.0, 146.0), _op("normalisation", 40.0, 25.0),
           _op("normalisation", 0.0, None)]  # fmt: skip
    floor = roofline_floor_ms(ops)
    assert floor == pytest.approx({"convolution": 0.080, "normalisation": 0.010})


def test_roofline_floor_lines_skip_fp8_engines_and_name_half_the_compile_step():
    table = {"ops": [_op("convolution", 100.0, 50.0)]}
    result = {"results": [
        {"system": "compile", "dtype": "fp16", "ms_per_step": 1.0},
        {"system": "engine", "dtype": "fp16", "ms_per_step": 0.6, "extra": {"op_table": table}},
        {"system": "engine", "dtype": "fp8", "ms_per_step": 0.7,
         "extra": {"op_table": {"ops": [_op("convolution", 100.0, 135.0, fp8=True)]}}},
    ]}  # fmt: skip
    lines = _readme_tables().roofline_floor_lines(result)
    assert len(lines) == 1
    assert lines[0].startswith("Engine fp16: 0.600 ms per step")
    assert "0.050 ms (convolution 0.050)" in lines[0] and "0.500 ms" in lines[0]


CODE = '''"""Module docs."""
import math

SCALE = 2
"""What SCALE is."""


def area(r):
    """Docs of area."""
    # a comment
    return math.pi * r * r * SCALE
'''


@pytest.mark.parametrize(
    ("edited", "same"),
    [
        pytest.param(CODE.replace("Docs of area.", "Area of a disc."), True, id="function_docstring"),
        pytest.param(CODE.replace("What SCALE is.", "The scale."), True, id="attribute_docstring"),
        pytest.param(CODE.replace('"""Module docs."""', ""), True, id="module_docstring_removed"),
        pytest.param(CODE.replace("# a comment", "# another comment").replace("r * r", "r*r"), True, id="format"),
        pytest.param(CODE.replace("SCALE = 2", "SCALE = 3"), False, id="constant"),
        pytest.param(CODE.replace("return math.pi", 'print("x")\n    return math.pi'), False, id="statement_added"),
        pytest.param(CODE.replace("r * r * SCALE", '(r * r * SCALE, "docs")[0]'), False, id="string_in_an_expression"),
    ],
)
def test_only_code_counts_as_a_change_of_the_measured_code(edited: str, same: bool) -> None:
    """A table stays fresh across docstring, comment and formatting edits of the code it measures, not others."""
    strip = _readme_tables().without_docstrings
    assert (strip(edited) == strip(CODE)) is same


def test_freshness_names_only_the_watched_paths_that_changed(monkeypatch):
    module = _readme_tables()
    monkeypatch.setattr(module, "changed_code", lambda sha, paths: (["src/fastdiff/bench/runner.py"], []))
    note = module.freshness("abc1234", "bench")
    assert note == "**Older than the code it measures: src/fastdiff/bench changed since abc1234.**"
    monkeypatch.setattr(module, "changed_code", lambda sha, paths: (list(paths), []))  # a commit the clone lacks
    assert "src/fastdiff/samplers, src/fastdiff/engine" in module.freshness("abc1234", "bench")


def test_compile_table_marks_the_fastest_and_keeps_failed_configurations(tmp_path, monkeypatch):
    module = _readme_tables()
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "t", "triton": "tr", "git_sha": "abc1234", "date": "2026-11-26T00"}
    rows = [{"config": "compile", "notes": "mode=a", "ms_per_forward": 2.0, "compile_s": 20.0},
            {"config": "compile+autotune", "notes": "mode=b", "ms_per_forward": 1.5, "compile_s": 200.0},
            {"config": "compile+freeze", "notes": "mode=c", "error": "RuntimeError: boom"}]  # fmt: skip
    sweep = {"env": env, "model": "m", "batch": 4, "calls": 10, "repeats": 3, "rows": rows}
    (tmp_path / "sweep-compile-m-b4-h100-2026-11-26.json").write_text(json.dumps(sweep))
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setattr(module, "freshness", lambda sha, table: "")
    lines = module.compile_table().splitlines()
    assert "| configuration | m batch 4 (h100) |" in lines
    assert "| compile (mode=a) | 2.000 (20 s) |" in lines
    assert "| compile+autotune (mode=b) | **1.500** (200 s) |" in lines
    assert "| compile+freeze (mode=c) | failed |" in lines
    assert any("median of 3 timed runs of 10" in line for line in lines)


def test_every_table_lives_in_exactly_one_document():
    module = _readme_tables()
    placed = [name for names in module.DOCUMENTS.values() for name in names]
    assert sorted(placed) == sorted(module.SECTIONS)
    assert set(module.MEASURED_CODE) >= set(module.SECTIONS) - {"t2i-model"}
    for document in module.DOCUMENTS:
        assert (ROOT / document).is_file(), document


def test_readme_is_a_user_guide_of_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_links_from_a_table_are_relative_to_its_document():
    module = _readme_tables()
    assert module.link_to("profile", ROOT / "docs" / "profile" / "x" / "report.md") == "profile/x/report.md"
    assert module.link_to("headline", ROOT / "docs" / "results.md") == "docs/results.md"


def test_headline_table_compares_the_engine_with_the_fastest_compile_of_its_run(tmp_path, monkeypatch):
    module = _readme_tables()
    env = {"gpu": "NVIDIA H100 80GB HBM3", "git_sha": "abc1234", "date": "2026-11-26T00"}
    rows = [{"system": "compile", "dtype": "fp16", "ms_per_step": 1.2},
            {"system": "compile+autotune", "dtype": "fp16", "ms_per_step": 1.0},
            {"system": "diffusers+compile", "dtype": "fp16", "ms_per_step": 2.0},
            {"system": "engine", "dtype": "fp16", "ms_per_step": 0.5},
            {"system": "engine", "dtype": "fp8", "ms_per_step": None, "error": "RuntimeError: boom"}]  # fmt: skip
    result = {"env": env, "config": {"model": "m", "batch": 4}, "results": rows}
    (tmp_path / "bench-m-b4-h100-2026-11-26.json").write_text(json.dumps(result))
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setattr(module, "is_stale", lambda sha, table: False)
    lines = module.headline_table().splitlines()
    assert lines[2] == (
        "| m | 4 | NVIDIA H100 80GB HBM3 | 0.500 | — | 1.000 (`compile+autotune`) | 2.000 | **2.00×** | 4.00× "
        "| git abc1234, 2026-11-26 |"
    )
    assert len(lines) == 3
    monkeypatch.setattr(module, "is_stale", lambda sha, table: True)
    assert "changed since run(s) abc1234" in module.headline_table()


def _commit(repo: Path, message: str) -> str:
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "add", "-A"], check=True, capture_output=True)
    subprocess.run([*git, "commit", "-q", "-m", message], check=True, capture_output=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_changed_code_follows_moves_and_ignores_paths_without_history(tmp_path, monkeypatch):
    """A file that moved with its code unchanged is not a change, under its old or its new watched path; an edit of
    its code is; a watched path that exists neither then nor now is never reported."""
    module = _readme_tables()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "area.py").write_text(CODE)
    (tmp_path / "old" / "other.py").write_text("X = 1\n")
    sha = _commit(tmp_path, "first")
    (tmp_path / "new").mkdir()
    (tmp_path / "old" / "area.py").rename(tmp_path / "new" / "area.py")
    (tmp_path / "new" / "area.py").write_text(CODE.replace("Docs of area.", "Area of a disc."))
    (tmp_path / "old" / "other.py").write_text("X = 2\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)  # staged, not committed: git diff sees it
    assert module.changed_code(sha, ("new", "missing")) == ([], ["new/area.py"])
    assert module.changed_code(sha, ("old/area.py",)) == ([], ["old/area.py"])
    assert module.changed_code(sha, ("old",)) == (["old/other.py"], ["old/area.py"])
    assert module.changed_code(sha, ("missing",)) == ([], [])
    assert module.changed_code("0" * 40, ("new", "missing")) == (["new"], [])  # a commit the clone lacks


def test_ready_table_takes_a_compile_run_without_engine_phases(tmp_path, monkeypatch):
    """A ``benchmarks/ready.py --system compile`` result has no engine phases (first forward, plan, capture) and no
    plan: its row says so with dashes instead of failing the generator."""
    tables = _readme_tables()
    summary = {"runs": 1, "import_s": {"mean": 3.0}, "load_s": {"mean": 1.0}, "call_ms": {"mean": 60.0},
               "to_first_image_s": {"best": 70.0, "mean": 70.0, "worst": 70.0}, "step_ms": {"mean": 3.1},
               "plan_sources": [], "plan_digests": [""], "ops_timed": [None]}  # fmt: skip
    result = {"env": {"git_sha": "abc1234", "gpu": "NVIDIA H100 80GB HBM3"},
              "config": {"model": "sd15", "batch": 1, "system": "compile"},
              "modes": {"cold": {"summary": summary, "rows": []}},
              "images_differing_between_processes": {"images": 1, "processes": 1, "differing": 0}}  # fmt: skip
    (tmp_path / "ready-sd15-b1-compile-h100.json").write_text(json.dumps(result))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    monkeypatch.setattr(tables, "freshness", lambda sha, table: f"note {sha}")
    row = tables.ready_table().splitlines()[2]
    assert "| sd15 | 1 | compile |" in row and "| – | – | – |" in row and "70.0 / 70.0 / 70.0 | 3.100 | – |" in row


def test_serve_table_takes_a_text_to_image_run_with_its_reference_and_targets(tmp_path, monkeypatch):
    """A ``scripts/gpu_loadtest_t2i.sh`` result: the reference server's rows, the targets, a run where nothing was
    answered (no latencies) and an unchecked batched-vs-solo comparison render without failing the generator."""
    tables = _readme_tables()
    run = {"concurrency": 1, "requests": 4, "images_per_s": 2.5, "latency_ms": {"p50": 400.0, "p95": 410.0,
           "p99": 420.0}, "ok": 4, "rejected_429": 0, "errors": 0}  # fmt: skip
    failed = {**run, "images_per_s": None, "latency_ms": None, "ok": 0, "errors": 4}
    result = {"env": {"git_sha": "abc1234", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": "2026-11-27"},
              "server": {"model": "sd15", "dtype": "fp16", "device": "cuda", "sampler": "ddim", "steps": 20,
                         "max_batch": 8, "batch_buckets": [1, 8], "max_wait_ms": 10, "queue_size": 32},
              "batched_vs_solo": {"byte_identical": None, "requests": 0, "images_per_request": 0,
                                  "note": "not checked"},
              "loadtests": {"k1": run}, "reference": {"server": {"system": "diffusers"}, "loadtests": {"k1": failed}},
              "baseline_sequential_batch1": {"images": 4, "images_per_s": 3.0, "latency_ms": {"p50": 330.0}},
              "targets": {"k32_images_per_s_vs_reference": {"value": 3.4, "target": ">= 3", "met": True}}}  # fmt: skip
    (tmp_path / "serve-loadtest-sd15-t2i-h100.json").write_text(json.dumps(result))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    monkeypatch.setattr(tables, "ROOT", tmp_path.parent)
    monkeypatch.setattr(tables, "freshness", lambda sha, table: f"note {sha}")
    text = tables.serve_table()
    assert "| fastdiff serve | k1 | 1 | 4 | 2.5 | 400 |" in text and "| diffusers | k1 | 1 | 4 | — | — |" in text
    assert "byte-identical: not checked" in text and "| k32_images_per_s_vs_reference | 3.40 | >= 3 | True |" in text
