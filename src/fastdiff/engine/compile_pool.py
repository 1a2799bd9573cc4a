"""Triton kernels compiled in worker processes before their first launch: a cold start's compiles on every core.

A Triton kernel compiles at its first launch, in the launching process, one kernel after another (host threads help
little: much of a compile holds the GIL). Here a set of calls is first *recorded*: each call runs with Triton's
``jit_cache_hook`` refusing every compile, so a launch that would compile hands over the kernel's specialization
(serialised as Triton's own ``JITFunction.preload`` reads it) and launches nothing. The kernels not yet in Triton's
on-disk cache go to worker processes (forked, each compiling its share one after another), which write them to that
cache, each with its host launcher. The calls then run as usual and load each kernel from the cache, as a second
process does: the cache key is computed from the same source, specialization, options, target and environment in
the worker and in the launch, so the binaries are those of an in-process compile.

    specs = record(calls)                      # nothing compiles; nothing that would compile launches
    compiled, failed = compile_in_workers(missing(specs), workers=16)

:func:`precompile` does all three and says what it did; :func:`compile_workers` is the number of workers
(``FASTDIFF_COMPILE_WORKERS``, default: one per CPU this process may use, at most :data:`MAX_WORKERS`; 1: none, the
launches compile in this process). Only CUDA devices compile this way, and only where processes fork (Linux).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import selectors
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_WORKERS = 16
"""The most worker processes :func:`compile_workers` starts by default."""
WORKER_TIMEOUT_S = 300.0
"""How long :func:`compile_in_workers` waits for its workers before it kills them (their kernels then compile at
launch): a guard against a worker that hangs, far above any compile measured (137 kernels took 12 s)."""
MIN_KERNELS = 2
"""Fewer kernels to compile than this compile in the launching process."""
COMPILED_MARKS = "fastdiff-compiled"
"""The folder of :func:`compiled_mark`'s files in Triton's cache folder."""


def compile_workers() -> int:
    """``FASTDIFF_COMPILE_WORKERS`` (at most the CPUs this process may use), else one per such CPU up to
    :data:`MAX_WORKERS`; 1 or less: kernels compile in the launching process."""
    cpus = len(os.sched_getaffinity(0))
    value = os.environ.get("FASTDIFF_COMPILE_WORKERS", "").strip()
    if value:
        try:
            return max(1, min(int(value), cpus))
        except ValueError:
            log.warning("ignoring FASTDIFF_COMPILE_WORKERS=%r: not an integer", value)
    return min(cpus, MAX_WORKERS)


_key_thread: threading.Thread | None = None


def hash_triton_in_background() -> None:
    """Start computing Triton's compiler key in a thread, once per process.

    Every kernel's cache key includes it: the SHA-256 of Triton's compiler sources and of its libtriton library. The
    first launch or cache lookup of a process computes it, on the main thread: 0.45 s of a warm SD 1.5 start on the
    H100 machine (``benchmarks/ready.py --profile``, git cf9cc86), 1.5 s on a 2-core CPU. Hashing releases the GIL,
    so begun when the engine is imported (this module, on a CUDA build of torch), it is done before the first launch
    of a warm start, while the rest of the import and the weights load. A launch that comes first computes the key
    itself, as without this. :func:`precompile` waits for the thread before it forks workers, which then inherit
    the key."""
    global _key_thread
    if _key_thread is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton that keeps it elsewhere: computed at the first launch, as usual
        return
    _key_thread = threading.Thread(target=triton_key, name="fastdiff-triton-key", daemon=True)
    _key_thread.start()


def _wait_for_triton_key() -> None:
    if _key_thread is not None:
        _key_thread.join()


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One Triton kernel specialization: the ``@triton.jit`` function by module and qualified name, Triton's JSON
    of its specialization (signature, constexprs, attributes, options) and the GPU target."""

    module: str
    name: str
    data: str
    target: dict[str, Any]


def current_target() -> dict[str, Any]:
    """The active GPU's Triton target (backend, arch, warp size), as :class:`KernelSpec` holds it."""
    from triton.runtime.driver import driver

    current = driver.active.get_current_target()
    return {"backend": current.backend, "arch": current.arch, "warp_size": current.warp_size}


def record(calls: Iterable[Callable[[], None]]) -> list[KernelSpec]:
    """The kernels that ``calls`` would compile, each once, in first-launch order. Every call runs with Triton's
    ``jit_cache_hook`` refusing each compile: a launch of a kernel that is not compiled in this process returns
    without launching; launches of compiled kernels and non-Triton work run (on whatever the buffers hold: callers
    run the real work afterwards). A call that fails is logged and left to the real run to report."""
    from triton import knobs

    target = current_target()
    found: dict[str, KernelSpec] = {}

    def refuse(*, fn: Any, compile: dict, **_: Any) -> bool:
        data = compile["specialization_data"]
        found.setdefault(data, KernelSpec(fn.module, fn.name, data, target))
        return True

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = refuse
    try:
        for call in calls:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the real run meets it again and reports it
                log.debug("a recorded call failed: %s", exc)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(found.values())


def jit_function(module: str, name: str) -> Any:
    """The ``JITFunction`` named ``module:name`` (through any wrapper that keeps it in ``.fn``)."""
    from triton.runtime.jit import JITFunction

    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def source(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """The compiler input of ``spec`` (``ASTSource``, or Gluon's) and its options, decoded as Triton's
    ``JITFunction.preload`` decodes its specialization data."""
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = jit_function(spec.module, spec.name)
    data = json.loads(spec.data)

    def constant(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
        if isinstance(value, dict) and "jit_function" in value:
            return jit_function(*value["jit_function"].split(":", 1))
        return convert_to_tuple_if_list(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_class
    else:
        source_class = ASTSource
    return source_class(fn, signature, constexprs, attrs), options


def gpu_target(spec: KernelSpec) -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget(spec.target["backend"], spec.target["arch"], spec.target["warp_size"])


def in_cache(spec: KernelSpec) -> bool:
    """Whether Triton's on-disk cache holds ``spec``'s binary (the lookup ``triton.compile`` makes first)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, options = source(spec)
    backend = make_backend(gpu_target(spec))
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    return name in (get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {})


def missing(specs: list[KernelSpec]) -> list[KernelSpec]:
    """``specs`` that Triton's on-disk cache lacks."""
    return [spec for spec in specs if not in_cache(spec)]


def compile_spec(spec: KernelSpec) -> None:
    """Compile ``spec`` into Triton's on-disk cache (what a worker does with each kernel it is given), and its host
    launcher with it (:func:`build_launcher`)."""
    import triton

    src, options = source(spec)
    build_launcher(triton.compile(src, target=gpu_target(spec), options=options))


def build_launcher(kernel: Any) -> None:
    """The host launcher of the compiled ``kernel``, built as its first launch builds it. Triton before 3.9 generates
    one C launcher per kernel signature and compiles it with the system C compiler at that launch, in the launching
    process, one after another, into the same on-disk cache: 18 of them took 7.2 s of a cold SD 1.5 start on the
    H100 (git 2d664ef). Built here, in the worker, the launch loads it. Building it loads a Python extension that
    makes no CUDA call (as a forked worker must not); a launcher that fails to build is left to the launch."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:  # noqa: BLE001 - the launch builds it again and reports what is wrong
        log.debug("a launcher could not be built ahead of its launch: %s", exc)


def compile_in_workers(
    specs: list[KernelSpec], workers: int, timeout_s: float = WORKER_TIMEOUT_S
) -> tuple[int, list[str]]:
    """Compile ``specs`` in ``workers`` forked processes at once (kernel i to worker i mod ``workers``); returns how
    many compiled and one line per failure (the launch compiles those itself, and reports what is wrong). Workers
    still running after ``timeout_s`` are killed and their kernels left to the launch.

    A forked worker starts in milliseconds with the parent's modules already imported (a fresh interpreter spent
    8-9 s importing torch and Triton beside 15 others on the H100 machine, git 708d16e). It only runs Triton's
    compiler and ptxas: no CUDA call, which a process forked from one that holds a CUDA context must not make."""
    count = min(workers, len(specs))
    children: list[tuple[int, int]] = []
    received: dict[int, bytes] = {}
    try:
        for share in (specs[i::count] for i in range(count)):
            read_fd, write_fd = os.pipe()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, fork() may deadlock"
                    pid = os.fork()
            except OSError:
                os.close(read_fd)
                os.close(write_fd)
                raise
            if pid == 0:  # the worker: answer each kernel of its share, then leave without the parent's exit handlers
                code = 0
                try:
                    os.close(read_fd)
                    with os.fdopen(write_fd, "w", buffering=1) as answers:  # a line per answer, as it comes
                        for spec in share:
                            answers.write(json.dumps(compile_answer(spec)) + "\n")
                except BaseException:  # noqa: BLE001 - the parent counts the kernels left unanswered
                    code = 1
                finally:
                    os._exit(code)
            os.close(write_fd)
            children.append((pid, read_fd))
            received[read_fd] = b""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for _, fd in children:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        received[key.fd] += chunk
                    else:
                        selector.unregister(key.fd)
    finally:  # whatever happened: every worker ended and reaped, every pipe closed
        for pid, fd in children:
            if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still compiling (the deadline, or an error here)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(fd)
    compiled, failures = 0, []
    for _, fd in children:
        for line in received[fd].decode(errors="replace").splitlines():
            try:
                answer = json.loads(line)
            except ValueError:  # a line cut short by a worker that was killed
                continue
            if answer["ok"]:
                compiled += 1
            else:
                failures.append(answer["error"])
    answered = compiled + len(failures)
    if answered < len(specs):
        failures.append(f"{len(specs) - answered} kernels got no answer (a worker ended early or ran out of time)")
    return compiled, failures


def compile_answer(spec: KernelSpec) -> dict[str, Any]:
    """``spec`` compiled into Triton's on-disk cache: ``{"ok": true}``, or ``{"ok": false, "error": one line}``."""
    try:
        compile_spec(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, whose launch compiles it again
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"ok": False, "error": f"{spec.module}:{spec.name}: {first}"}
    return {"ok": True}


@contextmanager
def counting_compiles() -> Iterator[dict[str, int]]:
    """Counts, while open, the kernels Triton compiles in this process (``compiled``) and loads from its on-disk
    cache (``loaded``), through its compilation listener."""
    from triton import knobs

    counts = {"compiled": 0, "loaded": 0}

    def listen(*, cache_hit: bool, **_: Any) -> None:
        counts["loaded" if cache_hit else "compiled"] += 1

    previous = knobs.compilation.listener
    knobs.compilation.listener = listen
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous


@functools.cache
def package_digest() -> str:
    """SHA-256 of every Python file of the fastdiff package (about 7 ms): a kernel's source, and so its Triton
    cache key, can only change with one of them."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compiled_mark(key: str) -> Path:
    """The empty file that says every kernel of the calls keyed ``key`` was in Triton's on-disk cache after a
    :func:`precompile`: kept in that cache's folder (emptying the cache drops the marks), named by a digest of
    ``key``, the Triton version, the GPU target, the package's sources (:func:`package_digest`) and every
    ``TRITON_*`` and ``FASTDIFF_*`` environment variable."""
    import triton
    from triton import knobs

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("TRITON_", "FASTDIFF_")))
    payload = repr((key, triton.__version__, current_target(), package_digest(), env))
    return Path(knobs.cache.dir) / COMPILED_MARKS / hashlib.sha256(payload.encode()).hexdigest()[:32]


def precompile(calls: list[Callable[[], None]], device_type: str, key: str | None = None) -> dict[str, float]:
    """Record ``calls``, compile what Triton's cache lacks in :func:`compile_workers` processes; returns what it did
    (``kernels``: recorded, ``to_compile``, ``compiled``, ``failed``, ``seconds``), empty where it does not apply
    (not CUDA, one worker). A recording or cache lookup that fails is logged: the launches then compile as usual.

    ``key`` names the kernels ``calls`` launch (for a fused forward: its structure and its choice of
    implementations): once a process has found or compiled all of them, it leaves a mark (:func:`compiled_mark`),
    and a later process with the same key skips the recording and the cache lookups (``skipped``: 1; 0.3-0.6 s of
    a warm SD 1.5 start on the H200, git 254bf51), its launches loading the kernels from the cache. Should the cache
    have lost a kernel since, that kernel compiles at its launch, as without workers."""
    workers = compile_workers()
    if device_type != "cuda" or workers <= 1 or not hasattr(os, "fork"):
        return {}
    start = time.perf_counter()
    mark = compiled_mark(key) if key is not None else None
    if mark is not None and mark.exists():
        return {"kernels": 0, "to_compile": 0, "compiled": 0, "failed": 0, "skipped": 1,
                "seconds": time.perf_counter() - start}  # fmt: skip
    _wait_for_triton_key()  # no fork while a thread runs; the workers inherit the key
    try:
        specs = record(calls)
        todo = missing(specs)
    except Exception as exc:  # noqa: BLE001 - a Triton whose internals differ: compile at launch instead
        log.warning("compiling at first launch: the kernels could not be recorded (%s)", exc)
        return {}
    done: dict[str, float] = {"kernels": len(specs), "to_compile": len(todo), "compiled": 0, "failed": 0}
    if len(todo) >= MIN_KERNELS:
        try:
            compiled, failures = compile_in_workers(todo, workers)
        except OSError as exc:  # no process or pipe to be had (a pid limit, memory): compile at launch
            log.warning("compiling at first launch: no compile workers (%s)", exc)
            compiled, failures = 0, [str(exc)]
        done.update(compiled=compiled, failed=len(failures))
        for failure in failures[:3]:
            log.info("a worker could not compile a kernel (its launch will): %s", failure)
    if mark is not None and not done["failed"]:  # all in the cache now (fewer than MIN_KERNELS: after the launch)
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError as exc:  # a read-only cache: the next process records again
            log.debug("no compiled mark at %s: %s", mark, exc)
    done["seconds"] = time.perf_counter() - start
    log.info(
        "%d kernels to compile of %d, %d compiled in %d workers (%.1f s)",
        len(todo), len(specs), done["compiled"], min(workers, len(todo)) if len(todo) >= MIN_KERNELS else 0,
        done["seconds"],
    )  # fmt: skip
    return done


if importlib.import_module("torch").version.cuda is not None:  # a CUDA build of torch: kernels may launch soon
    hash_triton_in_background()
