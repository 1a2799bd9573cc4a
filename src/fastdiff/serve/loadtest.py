"""``fastdiff loadtest``: K closed-loop clients send R requests to a running ``fastdiff serve``; throughput, latency.

Each client thread sends its next request as soon as the previous one is answered (after a short pause when it
was turned away with 429). Request i asks for seeds ``seed + i*n ...`` and, given ``prompts`` (for a
text-to-image server), prompt ``i mod len(prompts)``. Every answer is counted: 200 (images),
429 (shed) or an error (any other status, a timeout, a dropped connection); ``lost`` counts the requests that got
neither 200 nor 429, so an overload run (more clients than the server holds: max batch + queue) passes when none is
lost and the server is healthy afterwards.

Given the server's process id (``server_pid``), the summary also holds its memory before and after the load
(``sample_memory``: RSS from ``/proc``, GPU memory from NVML or nvidia-smi, and the torch allocator gauges that
``GET /metrics`` of ``fastdiff serve`` exposes) and the growth between them.
"""

from __future__ import annotations

import logging
import math
import shutil
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fastdiff.errors import FastdiffError
from fastdiff.serve.metrics import quantile

log = logging.getLogger(__name__)

REJECTED_PAUSE_S = 0.05
"""A client that got 429 waits this long before its next request (no busy loop against a full queue)."""

SCHEMA = "fastdiff.loadtest/1"
SERVER_TIMES = ("queue_ms", "sample_ms", "total_ms")
"""What an answer's ``timing`` says of its time in the server: waiting for a batch (the batcher's wait for company
included), sampling that batch, and arrival to encoded PNGs (the JSON body and the HTTP exchange come after)."""
MIB = 2**20
TORCH_MEMORY_GAUGES = {
    "fastdiff_gpu_memory_allocated_bytes": "torch_allocated_mib",
    "fastdiff_gpu_memory_reserved_bytes": "torch_reserved_mib",
}
"""``GET /metrics`` gauges of ``fastdiff serve`` (CUDA only) -> their ``sample_memory`` keys."""


@dataclass
class Answer:
    status: int
    """HTTP status; 0 when no answer came (timeout, connection error)."""
    latency_s: float
    images: int = 0
    batch_images: int | None = None
    error: str | None = None
    server_ms: dict[str, float] | None = None
    """The answer's own ``timing`` (``queue_ms``, ``sample_ms``, ``total_ms``), where the server gives one."""


def send_request(client: httpx.Client, body: dict) -> Answer:
    """POST one request and classify the answer."""
    start = time.perf_counter()
    try:
        response = client.post("/v1/images", json=body)
    except httpx.HTTPError as exc:
        return Answer(0, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    if response.status_code != 200:
        try:
            message = response.json().get("error", response.text)
        except ValueError:
            message = response.text
        return Answer(response.status_code, latency, error=f"{response.status_code}: {message}"[:300])
    data = response.json()
    timing = data["timing"]
    server_ms = {k: timing[k] for k in SERVER_TIMES if isinstance(timing.get(k), (int, float))}
    return Answer(200, latency, len(data["images"]), timing["batch_images"], server_ms=server_ms or None)


def run_loadtest(
    url: str,
    concurrency: int,
    requests: int,
    n: int = 1,
    steps: int | None = None,
    sampler: str | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
    prompts: Sequence[str] | None = None,
    server_pid: int | None = None,
) -> dict:
    """Run the load and return the summary record (see ``summarize``); ``server_pid``: also sample the server's
    memory before and after (``memory``: ``before``, ``after`` and ``growth``, see ``sample_memory``)."""
    if concurrency < 1 or requests < 1 or n < 1:
        raise FastdiffError(f"concurrency, requests and n must be positive, got {concurrency}, {requests}, {n}")
    if prompts is not None and not prompts:
        raise FastdiffError("prompts: give at least one prompt (or None for an unconditional server)")
    url = url.rstrip("/")
    try:
        httpx.get(f"{url}/health", timeout=10).raise_for_status()
        conditional = httpx.get(f"{url}/v1/model", timeout=10).raise_for_status().json()["conditional"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise FastdiffError(f"no healthy fastdiff server at {url}: {exc}".splitlines()[0]) from None
    if conditional and not prompts:
        raise FastdiffError(f"the server at {url} runs a text-to-image model: give prompts (--prompts FILE)")
    if prompts and not conditional:
        raise FastdiffError(f"the server at {url} runs an unconditional model: it takes no prompts")
    base = {"n": n} | ({"steps": steps} if steps else {}) | ({"sampler": sampler} if sampler else {})
    answers: list[Answer] = []
    lock = threading.Lock()
    next_index = iter(range(requests))

    def client_loop() -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                body = base | {"seed": seed + index * n}
                if prompts:
                    body["prompt"] = prompts[index % len(prompts)]
                answer = send_request(client, body)
                with lock:
                    answers.append(answer)
                if answer.status == 429:
                    time.sleep(REJECTED_PAUSE_S)

    memory_before = None if server_pid is None else sample_memory(url, server_pid)
    log.info("loadtest %s: %d clients, %d requests of n=%d", url, concurrency, requests, n)
    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, name=f"loadtest-{k}") for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    try:
        healthy_after = httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        healthy_after = False
    config = {
        "url": url,
        "concurrency": concurrency,
        "requests": requests,
        "n": n,
        "steps": steps,
        "sampler": sampler,
        "seed": seed,
        "prompts": None if prompts is None else len(prompts),
    }
    summary = summarize(answers, wall_s, config, healthy_after)
    if memory_before is not None:
        after = sample_memory(url, server_pid)
        summary["memory"] = {"before": memory_before, "after": after, "growth": memory_growth(memory_before, after)}
    return summary


def summarize(answers: list[Answer], wall_s: float, config: dict, healthy_after: bool) -> dict:
    """Counts by outcome, images/s and requests/s over the wall time, latency percentiles of the answered, and
    where the answered spent it (``server_p50_ms``: medians of their ``SERVER_TIMES``, and of the time outside the
    server's ``total_ms``: the JSON body, HTTP and the client's parsing; None where the server gives no timing).

    ``status_counts``: answers by HTTP status ("0": no answer); ``lost``: requests (``config["requests"]``, else the
    answers) that got neither 200 nor 429; ``all_answered``: none lost and every request accounted for.
    """
    ok = [a for a in answers if a.status == 200]
    latencies = sorted(a.latency_s * 1000 for a in ok)
    errors = [a for a in answers if a.status not in (200, 429)]
    batch_sizes = [a.batch_images for a in ok if a.batch_images is not None]
    images = sum(a.images for a in ok)
    sent = config.get("requests", len(answers))
    answered = sum(a.status in (200, 429) for a in answers)

    def ms(value: float) -> float | None:
        return None if math.isnan(value) else round(value, 3)

    timed = [a for a in ok if a.server_ms is not None and len(a.server_ms) == len(SERVER_TIMES)]
    server_p50 = None
    if timed:
        server_p50 = {k: ms(statistics.median(a.server_ms[k] for a in timed)) for k in SERVER_TIMES}
        server_p50["outside_ms"] = ms(statistics.median(a.latency_s * 1000 - a.server_ms["total_ms"] for a in timed))

    return {
        "schema": SCHEMA,
        **config,
        "wall_s": round(wall_s, 4),
        "ok": len(ok),
        "rejected_429": sum(a.status == 429 for a in answers),
        "errors": len(errors),
        "error_examples": sorted({a.error for a in errors if a.error})[:5],
        "images": images,
        "images_per_s": round(images / wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "latency_ms": {
            "p50": ms(quantile(latencies, 0.5)),
            "p95": ms(quantile(latencies, 0.95)),
            "p99": ms(quantile(latencies, 0.99)),
            "mean": ms(statistics.fmean(latencies)) if latencies else None,
            "max": ms(latencies[-1]) if latencies else None,
        },
        "mean_batch_images": round(statistics.fmean(batch_sizes), 3) if batch_sizes else None,
        "server_p50_ms": server_p50,
        "healthy_after": healthy_after,
        "status_counts": {str(code): count for code, count in sorted(Counter(a.status for a in answers).items())},
        "lost": sent - answered,
        "all_answered": answered == sent == len(answers),
    }


def read_rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` (``VmRSS`` of ``/proc/<pid>/status``); None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_memory_mib(pid: int | None) -> tuple[float | None, float | None]:
    """(GPU memory of process ``pid``, GPU memory used on every GPU together) in MiB, from NVML (nvidia-ml-py),
    else nvidia-smi; None for what neither tells (no GPU, or a PID namespace that hides the process)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            process, device = 0, 0
            found = False
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                device += pynvml.nvmlDeviceGetMemoryInfo(handle).used
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory is not None:
                        process += proc.usedGpuMemory
                        found = True
            return (round(process / MIB, 1) if found else None), round(device / MIB, 1)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (no GPU, no driver, nvidia-ml-py missing): ask nvidia-smi
        pass
    return nvidia_smi_memory_mib(pid)


def nvidia_smi_memory_mib(pid: int | None) -> tuple[float | None, float | None]:
    """``gpu_memory_mib`` through nvidia-smi's CSV queries."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None

    def query(*args: str) -> list[list[str]]:
        try:
            command = [smi, *args, "--format=csv,noheader,nounits"]
            out = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    def total(values: list[str]) -> float | None:
        try:
            return round(sum(float(v) for v in values), 1) if values else None
        except ValueError:
            return None

    device = total([row[0] for row in query("--query-gpu=memory.used")])
    process = total([row[1] for row in query("--query-compute-apps=pid,used_memory") if row[0] == str(pid)])
    return process, device


def prometheus_gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """The values of the unlabelled samples ``names`` in a Prometheus text exposition."""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            try:
                values[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return values


def sample_memory(url: str | None, pid: int | None) -> dict:
    """The server's memory now, in MiB (None where unknown): ``rss_mib`` (process ``pid``), ``gpu_process_mib``
    (process ``pid`` on every GPU), ``gpu_device_used_mib`` (everything on every GPU), and, where ``url``'s
    ``GET /metrics`` exposes them (``fastdiff serve`` on CUDA), ``torch_allocated_mib`` and ``torch_reserved_mib``."""
    process, device = gpu_memory_mib(pid)
    sample: dict = {
        "time": round(time.time(), 3),
        "rss_mib": None if pid is None else read_rss_mib(pid),
        "gpu_process_mib": process,
        "gpu_device_used_mib": device,
    }
    if url is not None:
        try:
            response = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10)
            gauges = prometheus_gauges(response.text, list(TORCH_MEMORY_GAUGES)) if response.status_code == 200 else {}
        except httpx.HTTPError:
            gauges = {}
        for name, key in TORCH_MEMORY_GAUGES.items():
            if name in gauges:
                sample[key] = round(gauges[name] / MIB, 1)
    return sample


def memory_growth(before: dict, after: dict) -> dict:
    """``after - before`` for every memory figure (keys ending in ``_mib``) known in both samples."""
    return {
        key: round(after[key] - value, 1)
        for key, value in before.items()
        if key.endswith("_mib") and isinstance(value, int | float) and isinstance(after.get(key), int | float)
    }
