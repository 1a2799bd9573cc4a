"""The README's result tables are generated from benchmarks/results/*.json and must be up to date."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_are_generated_from_results():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_tables.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
