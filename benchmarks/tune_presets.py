"""Kernel plans for the presets at the batch sizes the bench and ``make sample`` use, each made by ``fastdiff tune``
in a fresh process from empty Triton and fastdiff caches (the cold, no-plan time a user meets), into one plan file.

    python benchmarks/tune_presets.py --plan plans.json --out tune.json ddpm-cifar10:1 fashion-mnist-t2i:80:3

A job is ``MODEL:BATCH[:GUIDANCE[:DTYPE]]`` (guidance: text-to-image models, default 7.5; dtype: ``fastdiff tune``'s,
default fp16). Jobs run in the order given
while ``--budget-s`` leaves room for one (a job that would not finish is skipped and said so). ``--shared-caches``
starts from empty caches once and lets each job reuse the kernels the jobs before it compiled (to make a plan file in
fewer minutes; the wall times are then not the cold start a user meets, and the result says so). The result records
each job's wall time, exit status, the compile workers (``FASTDIFF_COMPILE_WORKERS``) and the environment; the
plan file is what ``src/fastdiff/engine/plans/<gpu>.json`` ships (merged with ``KernelPlan``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def parse_job(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3, 4):
        raise SystemExit(f"bad job {text!r}: MODEL:BATCH[:GUIDANCE[:DTYPE]]")
    job: dict = {"model": parts[0], "batch": int(parts[1])}
    if len(parts) >= 3:
        job["guidance"] = float(parts[2])
    if len(parts) == 4:
        job["dtype"] = parts[3]
    return job


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="+", help="MODEL:BATCH[:GUIDANCE[:DTYPE]]")
    p.add_argument("--plan", type=Path, required=True, help="plan file the jobs add to")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting jobs after this long")
    p.add_argument("--job-timeout-s", type=float, default=400.0)
    p.add_argument("--shared-caches", action="store_true", help="one set of empty caches for all jobs, not one each")
    args = p.parse_args()

    from fastdiff.atomic import write_text_atomic
    from fastdiff.bench.env import environment

    start = time.perf_counter()
    rows = []
    shared = tempfile.mkdtemp(prefix="tune-shared-") if args.shared_caches else None
    workers = os.environ.get("FASTDIFF_COMPILE_WORKERS", "default")
    for job in map(parse_job, args.jobs):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            rows.append({**job, "skipped": f"{left:.0f} s of the budget left"})
            print("skipped", job, flush=True)
            continue
        cold = shared or tempfile.mkdtemp(prefix="tune-cold-")
        env = {**os.environ, "TRITON_CACHE_DIR": f"{cold}/triton", "FASTDIFF_CACHE_DIR": f"{cold}/fastdiff",
               "TORCHINDUCTOR_CACHE_DIR": f"{cold}/inductor", "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
        argv = [sys.executable, "-m", "fastdiff.cli", "tune", "--model", job["model"], "--batch", str(job["batch"]),
                "--out", str(args.plan)]  # fmt: skip
        if "guidance" in job:
            argv += ["--guidance", str(job["guidance"])]
        if "dtype" in job:
            argv += ["--dtype", job["dtype"]]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=min(args.job_timeout_s, left))
            rc, log_tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, log_tail = "timeout", ""
        if shared is None:
            shutil.rmtree(cold, ignore_errors=True)
        row = {**job, "wall_s": round(time.perf_counter() - t0, 2), "rc": rc, "compile_workers": workers,
               "log_tail": log_tail.splitlines()[-3:]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        what = "fastdiff tune per preset from empty caches (cold, no plan)"
        if shared is not None:
            what = "fastdiff tune per preset, the jobs in order sharing one set of caches that started empty"
        result = {"what": what, "shared_caches": shared is not None, "env": environment(), "jobs": rows}
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    main()
