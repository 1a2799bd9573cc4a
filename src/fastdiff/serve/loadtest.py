"""``fastdiff loadtest``: K closed-loop clients send R requests to a running ``fastdiff serve``; throughput, latency.

Each client thread sends its next request as soon as the previous one is answered (after a short pause when it
was turned away with 429). Request i asks for seeds ``seed + i*n ...`` and, given ``prompts`` (for a
text-to-image server), prompt ``i mod len(prompts)``. Every answer is counted: 200 (images),
429 (shed) or an error (any other status, a timeout, a dropped connection).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from fastdiff.errors import FastdiffError
from fastdiff.serve.metrics import quantile

log = logging.getLogger(__name__)

REJECTED_PAUSE_S = 0.05
"""A client that got 429 waits this long before its next request (no busy loop against a full queue)."""

SCHEMA = "fastdiff.loadtest/1"


@dataclass
class Answer:
    status: int
    """HTTP status; 0 when no answer came (timeout, connection error)."""
    latency_s: float
    images: int = 0
    batch_images: int | None = None
    error: str | None = None


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
    return Answer(200, latency, images=len(data["images"]), batch_images=data["timing"]["batch_images"])


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
) -> dict:
    """Run the load and return the summary record (see ``summarize``)."""
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
    return summarize(answers, wall_s, config, healthy_after)


def summarize(answers: list[Answer], wall_s: float, config: dict, healthy_after: bool) -> dict:
    """Counts by outcome, images/s and requests/s over the wall time, latency percentiles of the answered."""
    ok = [a for a in answers if a.status == 200]
    latencies = sorted(a.latency_s * 1000 for a in ok)
    errors = [a for a in answers if a.status not in (200, 429)]
    batch_sizes = [a.batch_images for a in ok if a.batch_images is not None]
    images = sum(a.images for a in ok)

    def ms(value: float) -> float | None:
        return None if math.isnan(value) else round(value, 3)

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
        "healthy_after": healthy_after,
    }
