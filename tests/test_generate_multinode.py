"""``fastdiff generate`` on two "nodes" of two processes each (two ``torchrun --nnodes 2`` on one host, gloo on the
CPU, one shared folder): the same bytes as one process, unconditional and with ``--prompts``; a killed node makes
the other fail in one line within ``--timeout``, and rerunning both nodes completes the job byte for byte."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from fastdiff.cli import main
from fastdiff.generate import IDENTITY_KEYS, PROMPT_IDENTITY_KEYS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a node's processes in /proc"),
]

FIRST_SEED = 3
NUM_IMAGES = 20  # batch 2: ten chunks, dealt to ranks 0-3 as 3, 3, 2, 2
TIMEOUT_S = 20
NODE_WAIT_S = 120


def job_argv(out_dir: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", "fashion-mnist", "--out-dir", str(out_dir), "--num-images", str(NUM_IMAGES),
        "--first-seed", str(FIRST_SEED), "--steps", "2", "--batch", "2", "--device", "cpu", "--no-progress",
        "--timeout", str(TIMEOUT_S), *extra,
    ]  # fmt: skip


def prompts_argv(prompts: Path, out_dir: Path) -> list[str]:
    return [
        "generate", "--model", "fashion-mnist-t2i", "--prompts", str(prompts), "--num-images", "8", "--out-dir",
        str(out_dir), "--steps", "2", "--batch", "2", "--device", "cpu", "--no-progress", "--timeout", str(TIMEOUT_S),
    ]  # fmt: skip


def one_process(argv: list[str]) -> None:
    """``argv`` in this process on one thread (as each torchrun rank runs): the files the nodes must reproduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)


def pngs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".png"}


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".png"}


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(
    entry: list[str], logs: Path, node_1_entry: list[str] | None = None, nproc: int = 2
) -> list[subprocess.Popen]:
    """Two ``torchrun --nnodes 2 --nproc-per-node NPROC`` of ``entry`` (a script or ``-m module``, then its argv;
    node 1: ``node_1_entry`` if given), each in its own session, stderr to ``logs/node{N}.err``."""
    port = free_port()
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *(node_1_entry or entry if node else entry),
        ]  # fmt: skip
        with open(logs / f"node{node}.err", "w") as err:
            nodes.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True))
    return nodes


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts each worker in a session of its own, so killing the
    launcher's process group would leave the workers running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun and all its workers, as when the machine dies."""
    for pid in descendants(node.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait(timeout=NODE_WAIT_S)


def finish(nodes: list[subprocess.Popen], logs: Path) -> list[str]:
    """Wait for both nodes (killing what is left on a timeout); each node's stderr."""
    try:
        for node in nodes:
            node.wait(timeout=NODE_WAIT_S)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    return [(logs / f"node{n}.err").read_text() for n in (0, 1)]


def run_nodes(entry: list[str], logs: Path, nproc: int = 2) -> list[str]:
    nodes = start_nodes(entry, logs, nproc=nproc)
    errors = finish(nodes, logs)
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    return errors


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    one_process(job_argv(out))
    return out


def test_two_nodes_write_the_same_bytes_as_one_process(reference, tmp_path):
    out = tmp_path / "out"
    run_nodes(["-m", "fastdiff.cli", *job_argv(out)], tmp_path / "logs")
    assert pngs(out) == pngs(reference) and len(pngs(out)) == NUM_IMAGES
    assert manifest(out) == manifest(reference)  # the identity (IDENTITY_KEYS) and what the folder holds
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and [r["images"] for r in summary["ranks"]] == [6, 6, 4, 4]
    assert {p.name for p in out.iterdir()} == set(pngs(reference)) | {"manifest.json", "summary.json"}


def test_two_nodes_of_a_prompts_job_write_the_same_bytes_as_one_process(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ankle boot\nbag\nsneaker\n")
    one_process(prompts_argv(prompts, tmp_path / "reference"))
    # two nodes of one process each: four processes loading the text encoder on two cores would double the time
    run_nodes(["-m", "fastdiff.cli", *prompts_argv(prompts, tmp_path / "out")], tmp_path / "logs", nproc=1)
    assert pngs(tmp_path / "out") == pngs(tmp_path / "reference") and len(pngs(tmp_path / "out")) == 8
    found, expected = manifest(tmp_path / "out"), manifest(tmp_path / "reference")
    assert (
        all(found.get(key) == expected.get(key) for key in (*IDENTITY_KEYS, *PROMPT_IDENTITY_KEYS))
        and found == expected
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["images"] for r in summary["ranks"]] == [4, 4]


STALL_NODE_1 = """
import os, sys, time
from pathlib import Path
import fastdiff.generate
from fastdiff.cli import main

publish = fastdiff.generate.publish
published = []

def publish_or_stall(tmp, path):
    # node 1's ranks publish their first chunk, then stall (files flushed, not yet renamed) until the node is
    # killed: the job cannot end before the kill
    if os.environ["GROUP_RANK"] == "1" and len(published) == 2:
        Path(os.environ["STALLED"], os.environ["RANK"]).touch()
        time.sleep(600)
    publish(tmp, path)
    published.append(path)

fastdiff.generate.publish = publish_or_stall
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_node_fails_the_other_in_one_line_and_a_rerun_completes_the_job(reference, tmp_path, monkeypatch):
    out, logs, stalled = tmp_path / "out", tmp_path / "logs", tmp_path / "stalled"
    stalled.mkdir()
    script = tmp_path / "stall_node_1.py"
    script.write_text(STALL_NODE_1)
    monkeypatch.setenv("STALLED", str(stalled))
    nodes = start_nodes([str(script), *job_argv(out)], logs)
    try:
        deadline = time.monotonic() + NODE_WAIT_S
        while len(list(stalled.iterdir())) < 2 and nodes[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(p.name for p in stalled.iterdir()) == ["2", "3"], (logs / "node0.err").read_text()[-3000:]
        kill_node(nodes[1])
        killed_at = time.monotonic()
        nodes[0].wait(timeout=TIMEOUT_S + 10)
        waited = time.monotonic() - killed_at
    finally:
        errors = finish(nodes, logs)
    assert nodes[0].returncode != 0 and waited < TIMEOUT_S, errors[0][-3000:]
    lines = [line for line in errors[0].splitlines() if line.startswith("fastdiff: error:")]
    assert len(lines) == 1, errors[0][-3000:]
    assert lines[0].startswith("fastdiff: error: rank 0 of 4 lost the other processes (")
    assert "run the same command again on every node" in lines[0]
    assert "generate.py" not in errors[0]  # no traceback of a worker, only torchrun's own report

    before = mtimes(out)
    expected = pngs(reference)
    assert 0 < len(before) < NUM_IMAGES
    for name, data in pngs(out).items():  # whole files only: each one decodes and is the reference's
        Image.open(out / name).load()
        assert data == expected[name]
    assert [p for p in out.iterdir() if p.name.startswith(".")]  # the stalled writes' temporary files

    run_nodes(["-m", "fastdiff.cli", *job_argv(out)], logs)
    assert pngs(out) == expected
    assert manifest(out) == manifest(reference)
    assert all(mtimes(out)[name] == mtime for name, mtime in before.items())  # finished images were not redone
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["already_present"] == len(before) and summary["written"] == NUM_IMAGES - len(before)


def test_nodes_that_do_not_share_the_folder_are_refused_before_sampling(tmp_path):
    here, there = tmp_path / "node0" / "out", tmp_path / "node1" / "out"
    there.mkdir(parents=True)  # node 1's own folder of that name: what a path on a node-local disk would be
    logs = tmp_path / "logs"
    nodes = start_nodes(  # --timeout 8: a rank looks for rank 0's probe file for a quarter of it, 2 s
        ["-m", "fastdiff.cli", *job_argv(here, "--timeout", "8")],
        logs,
        node_1_entry=["-m", "fastdiff.cli", *job_argv(there, "--timeout", "8")],
        nproc=1,  # two nodes of one process each: the check is the same, the test is shorter
    )
    errors = finish(nodes, logs)
    assert [node.returncode != 0 for node in nodes] == [True, True]
    lines = [line for line in errors[0].splitlines() if line.startswith("fastdiff: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"fastdiff: error: rank 1: --out-dir {there} on "), errors[0][-3000:]
    assert "is not the folder rank 0 prepared" in lines[0] and "a filesystem that all of them share" in lines[0]
    assert not here.exists() and not list(there.iterdir())  # nothing sampled, nothing left behind
