"""What the torchrun tests share: a two-process gloo launch and the script of a rank killed in mid-chunk.

Import as ``from torchrun_helpers import ...`` (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(*argv: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2`` (gloo on the CPU, one thread a rank) of ``argv`` (a module with
    ``-m``, or a script)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def kill_rank_1_script(written: str, dies_at: str) -> str:
    """A script running ``fastdiff.cli.main`` in which rank 1 dies by SIGKILL when about to publish file ``dies_at``,
    once ``written`` (of the same chunk) is on disk: a chunk cut in half."""
    return f"""
import os, signal, sys, time
import fastdiff.generate
from fastdiff.cli import main

publish = fastdiff.generate.publish

def publish_or_die(tmp, path):
    if os.environ["RANK"] == "1" and path.name == {dies_at!r}:
        while not path.with_name({written!r}).exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    publish(tmp, path)

fastdiff.generate.publish = publish_or_die
sys.exit(main(sys.argv[1:]))
"""
