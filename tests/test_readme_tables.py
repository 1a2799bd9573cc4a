"""The README's result tables are generated from benchmarks/results/*.json and must be up to date."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_are_generated_from_results():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_tables.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + sorted(
    (ROOT / "docs" / "profile").glob("*/report.json")
)
UNKNOWN_COMMIT = {"kernels-h100.json"}
"""Results measured before runs recorded their commit; the README marks their tables as older than the code."""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_names_a_commit_of_this_history(path):
    if _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    sha = json.loads(path.read_text())["env"].get("git_sha")
    if path.name in UNKNOWN_COMMIT:
        assert sha is None, f"{path.name} now names {sha}: drop it from UNKNOWN_COMMIT"
        return
    assert sha, f"{path} names no commit"
    assert _git("merge-base", "--is-ancestor", sha, "HEAD").returncode == 0, f"{sha} is not an ancestor of HEAD"
