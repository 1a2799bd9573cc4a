"""``fastdiff.engine.compile_pool``: kernels compiled in worker processes. Recording and compiling need a GPU's driver
and ptxas (``benchmarks/ready.py`` measures them there); here: the worker count, the decoding of Triton's
specialization data into the same compiler input as the launch's (so the worker's cache key is the launch's), and
the forked workers' answers end to end (each kernel answered, failures reported, none lost)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import sys
import types

import pytest
import torch

from fastdiff.engine.compile_pool import KernelSpec, compile_in_workers, compile_workers, precompile, source

KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if FLAG:
        x = x * alpha
    tl.store(y_ptr + offs, x.to(DTYPE), mask=offs < n)
"""
TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}


@pytest.fixture
def kernel_module(tmp_path, monkeypatch):
    """A module with one ``@triton.jit`` kernel compiled as on a GPU (a ``JITFunction``, not the interpreter's)."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    (tmp_path / "pool_kernel_module.py").write_text(KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("pool_kernel_module")
    sys.modules.pop("pool_kernel_module", None)


def serialized(kernel, signature, constants, attrs, options) -> str:
    """Triton's own specialization JSON (what its ``jit_cache_hook`` hands over), whichever Triton is installed."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import serialize_specialization_data

    args = ["scale_kernel", signature, constants, attrs, options, "key"]
    if "target" in inspect.signature(serialize_specialization_data).parameters:
        args.append(GPUTarget(**TARGET))
    return serialize_specialization_data(*args)


def test_decoded_source_hashes_as_the_launch_s(kernel_module):
    """The worker's compiler input from the JSON hashes exactly as the one the launch builds from live values: tuple
    paths, divisibility attributes, an int, a bool and a dtype constexpr, options' lists back to tuples."""
    import triton.language as tl
    from triton.compiler import ASTSource

    kernel = kernel_module.scale_kernel
    signature = {"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr",
                 "FLAG": "constexpr", "DTYPE": "constexpr"}  # fmt: skip
    constants = {(4,): 128, (5,): True, (6,): tl.float16}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    options = types.SimpleNamespace(num_warps=4, num_stages=3, supported_fp8_dtypes=("fp8e4nv", "fp8e5"))
    spec = KernelSpec("pool_kernel_module", "scale_kernel", serialized(kernel, signature, constants, attrs, options),
                      TARGET)  # fmt: skip
    src, decoded = source(spec)
    assert type(src) is ASTSource
    assert src.hash() == ASTSource(kernel, signature, constants, attrs).hash()
    assert decoded == {"num_warps": 4, "num_stages": 3, "supported_fp8_dtypes": ("fp8e4nv", "fp8e5")}
    other = dict(constants)
    other[(4,)] = 64
    assert src.hash() != ASTSource(kernel, signature, other, attrs).hash()  # the hash does see the constants


def test_workers_answer_every_kernel_and_report_failures():
    """Two forked workers, three kernels none of which can compile here: three one-line failures (worker 0's two,
    then worker 1's), nothing compiled."""
    data = json.dumps({"signature": {}, "constant_keys": [], "constant_vals": [], "attrs_keys": [], "attrs_vals": [],
                       "options": {}})  # fmt: skip
    specs = [
        KernelSpec("fastdiff_no_such_module", "kernel", data, TARGET),
        KernelSpec("fastdiff.kernels.layer_norm", "no_such_kernel", data, TARGET),
        KernelSpec("fastdiff_no_such_module", "other", data, TARGET),
    ]
    compiled, failures = compile_in_workers(specs, workers=2)
    assert compiled == 0
    assert len(failures) == 3
    assert failures[0].startswith("fastdiff_no_such_module:kernel: ") and "No module named" in failures[0]
    assert failures[1].startswith("fastdiff_no_such_module:other: ")  # worker 0's second, read before worker 1's
    assert failures[2].startswith("fastdiff.kernels.layer_norm:no_such_kernel: ")
    assert all("\n" not in f for f in failures)


def test_a_worker_past_its_time_is_killed_and_its_kernels_left_to_the_launch(monkeypatch):
    """A worker that hangs (here: sleeps in its first kernel) is killed at the deadline; the other worker's answers
    still count, and the hung one's kernels are reported unanswered."""
    import time

    from fastdiff.engine import compile_pool

    def answer(spec):
        if spec.name == "hangs":
            time.sleep(60)
        return {"ok": True}

    monkeypatch.setattr(compile_pool, "compile_answer", answer)  # the forked workers run this process's code
    specs = [KernelSpec("m", name, "{}", TARGET) for name in ("hangs", "fine", "after", "fine2")]
    start = time.monotonic()
    compiled, failures = compile_in_workers(specs, workers=2, timeout_s=2.0)
    assert time.monotonic() - start < 20
    assert compiled == 2  # worker 1: "fine" and "fine2"
    assert failures == ["2 kernels got no answer (a worker ended early or ran out of time)"]


def test_a_failed_fork_leaves_no_worker_or_pipe_behind(monkeypatch):
    """The second fork fails (a pid limit): the error reaches the caller (``precompile`` then compiles at launch),
    the first worker is ended and reaped, and every pipe is closed."""
    import time

    from fastdiff.engine import compile_pool

    def answer(spec):
        time.sleep(60)
        return {"ok": True}

    real_fork, forks, started = os.fork, [], []

    def fork():
        if forks:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        forks.append(1)
        pid = real_fork()
        if pid:
            started.append(pid)
        return pid

    monkeypatch.setattr(compile_pool, "compile_answer", answer)
    monkeypatch.setattr(os, "fork", fork)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(BlockingIOError):
        compile_in_workers([KernelSpec("m", n, "{}", TARGET) for n in ("a", "b")], workers=2, timeout_s=30)
    assert set(os.listdir("/proc/self/fd")) <= fds
    with pytest.raises(ChildProcessError):
        os.waitpid(started[0], os.WNOHANG)  # reaped already


def test_worker_count(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("FASTDIFF_COMPILE_WORKERS", raising=False)
    assert compile_workers() == min(cpus, 16)
    monkeypatch.setenv("FASTDIFF_COMPILE_WORKERS", "1")
    assert compile_workers() == 1
    monkeypatch.setenv("FASTDIFF_COMPILE_WORKERS", "0")
    assert compile_workers() == 1
    monkeypatch.setenv("FASTDIFF_COMPILE_WORKERS", "many")
    assert compile_workers() == min(cpus, 16)


def test_precompile_does_nothing_off_cuda():
    calls = []
    assert precompile([lambda: calls.append(1)], torch.device("cpu").type) == {}
    assert calls == []  # not even recorded: the interpreter compiles nothing


def test_the_worker_builds_the_kernels_launcher_and_survives_a_failed_one(monkeypatch):
    """Triton before 3.9 compiles a C launcher per kernel signature at the kernel's first launch, serially in the
    launching process (7.2 s of a cold SD 1.5 start): the worker builds it from the kernel it compiled, with the
    launch's own class and inputs; a launcher that fails to build does not fail the kernel (the launch builds it)."""
    import triton
    from triton.runtime.driver import driver

    import fastdiff.engine.compile_pool as pool

    built = []

    class Launcher:
        def __init__(self, src, metadata):
            if metadata == "broken":
                raise RuntimeError("cc failed")
            built.append((src, metadata))

    kernel = types.SimpleNamespace(src="the compiled source", metadata="its metadata")
    monkeypatch.setattr(pool, "source", lambda spec: ("decoded", {"num_warps": 4}))
    monkeypatch.setattr(triton, "compile", lambda src, target, options: kernel)
    monkeypatch.setattr(driver, "_active", types.SimpleNamespace(launcher_cls=Launcher))
    spec = KernelSpec("m", "k", "{}", TARGET)
    assert pool.compile_answer(spec) == {"ok": True}
    assert built == [("the compiled source", "its metadata")]
    kernel.metadata = "broken"
    assert pool.compile_answer(spec) == {"ok": True}
    assert len(built) == 1


def test_triton_key_is_hashed_once_in_the_background(monkeypatch):
    """The compiler key that every kernel's cache key includes is computed by a thread (a launch after it finds it
    cached), and only once per process; Triton's interpreter needs none."""
    from triton.runtime.cache import triton_key

    import fastdiff.engine.compile_pool as pool

    monkeypatch.setattr(pool, "_key_thread", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pool.hash_triton_in_background()  # the interpreter: nothing to hash
    assert pool._key_thread is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pool, "_key_thread", None)
    triton_key.cache_clear()
    pool.hash_triton_in_background()
    thread = pool._key_thread
    assert thread is not None and thread.daemon
    pool.hash_triton_in_background()  # once per process
    assert pool._key_thread is thread
    pool._wait_for_triton_key()
    assert not thread.is_alive() and triton_key.cache_info().currsize == 1
    misses = triton_key.cache_info().misses
    assert triton_key().startswith(__import__("triton").__version__) and triton_key.cache_info().misses == misses


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """``precompile`` as on a GPU with 4 workers, Triton's cache under ``tmp_path``: the recording and the cache
    lookups replaced by a count (the fixture's ``["record"]``), the workers by a stand-in that compiles everything."""
    from triton import knobs

    from fastdiff.engine import compile_pool

    counts = {"record": 0}
    spec = KernelSpec("m", "k", "{}", TARGET)

    def record(fns):
        counts["record"] += 1
        return [spec, dataclasses.replace(spec, name="k2")]

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setattr(compile_pool, "compile_workers", lambda: 4)
    monkeypatch.setattr(compile_pool, "current_target", lambda: TARGET)
    monkeypatch.setattr(compile_pool, "record", record)
    monkeypatch.setattr(compile_pool, "missing", lambda specs: specs)
    monkeypatch.setattr(compile_pool, "compile_in_workers", lambda todo, workers: (len(todo), []))
    return counts


def test_a_compiled_mark_lets_the_next_process_skip_the_recording(fake_gpu, monkeypatch):
    """The first precompile of a key records and compiles, then marks the key; the next skips both (its launches load
    from the cache). Another key, a changed environment variable or a failed compile records again."""
    from fastdiff.engine import compile_pool

    first = precompile([lambda: None], "cuda", key="forward-a")
    assert fake_gpu["record"] == 1 and first["compiled"] == 2 and "skipped" not in first
    again = precompile([lambda: None], "cuda", key="forward-a")
    assert fake_gpu["record"] == 1 and again["skipped"] == 1 and again["kernels"] == 0
    precompile([lambda: None], "cuda", key="forward-b")
    assert fake_gpu["record"] == 2
    monkeypatch.setenv("FASTDIFF_SOME_KNOB", "1")  # a setting that may change the kernels: another mark
    precompile([lambda: None], "cuda", key="forward-a")
    assert fake_gpu["record"] == 3
    precompile([lambda: None], "cuda")  # no key: never marked, always recorded
    precompile([lambda: None], "cuda")
    assert fake_gpu["record"] == 5
    monkeypatch.setattr(compile_pool, "compile_in_workers", lambda todo, workers: (1, ["ptxas failed"]))
    assert precompile([lambda: None], "cuda", key="forward-c")["failed"] == 1
    precompile([lambda: None], "cuda", key="forward-c")  # not marked: a kernel is missing from the cache
    assert fake_gpu["record"] == 7


def test_the_mark_lives_in_tritons_cache_and_names_the_sources(fake_gpu, tmp_path):
    """Emptying Triton's cache drops the marks with the kernels; the mark's name covers the package's sources."""
    from fastdiff.engine.compile_pool import COMPILED_MARKS, compiled_mark, package_digest

    mark = compiled_mark("forward-a")
    assert mark.parent == tmp_path / "triton" / COMPILED_MARKS
    assert compiled_mark("forward-a") == mark != compiled_mark("forward-b")
    assert len(package_digest()) == 64
