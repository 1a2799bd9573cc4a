"""``ConcurrentLaunches`` (``fastdiff tune``'s candidate compiles): first launches from several host threads (CUDA),
in order elsewhere; the thread count."""

from __future__ import annotations

import os

import pytest
import torch

from fastdiff.engine.tuning import ConcurrentLaunches, compile_threads


def test_thread_count_follows_the_environment(monkeypatch):
    """One thread unless FASTDIFF_COMPILE_THREADS asks for more (at most the CPUs this process may use)."""
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("FASTDIFF_COMPILE_THREADS", "3")
    assert compile_threads() == min(3, cpus)
    monkeypatch.setenv("FASTDIFF_COMPILE_THREADS", "0")
    assert compile_threads() == 1
    monkeypatch.setenv("FASTDIFF_COMPILE_THREADS", "many")
    assert compile_threads() == 1
    monkeypatch.delenv("FASTDIFF_COMPILE_THREADS")
    assert compile_threads() == 1


def test_off_cuda_the_calls_run_at_once_in_order_and_failures_raise():
    order = []
    with ConcurrentLaunches(torch.device("cpu")) as launches:
        for i in range(5):
            launches.submit(lambda i=i: order.append(i))
            assert order == list(range(i + 1))  # ran before submit returned
    assert not launches.concurrent
    with pytest.raises(ZeroDivisionError), ConcurrentLaunches(torch.device("cpu")) as launches:
        launches.submit(lambda: 1 / 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_call_runs_and_a_failure_is_left_to_the_caller(monkeypatch):
    monkeypatch.setenv("FASTDIFF_COMPILE_THREADS", "4")
    device = torch.device("cuda")
    out = torch.zeros(64, device=device)
    with ConcurrentLaunches(device) as launches:
        assert launches.concurrent
        for i in range(64):
            launches.submit(lambda i=i: out[i].fill_(i + 1))
        launches.submit(lambda: 1 / 0)  # logged, not raised
    assert torch.equal(out.cpu(), torch.arange(1, 65, dtype=torch.float32))
