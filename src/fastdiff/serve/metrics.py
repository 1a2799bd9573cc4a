"""Service counters and their Prometheus text rendering (``GET /metrics``); safe to update from any thread."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque

import torch

LATENCY_QUANTILES = (0.5, 0.95, 0.99)
LATENCY_WINDOW = 1000
"""The latency quantiles are over the last this-many answered requests."""

THROUGHPUT_WINDOW_S = 60.0
"""``fastdiff_images_per_second`` counts the images finished in the last this-many seconds."""


def batch_size_buckets(max_batch: int) -> tuple[int, ...]:
    """Histogram bounds for batch sizes: 1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    bounds = []
    size = 1
    while size < max_batch:
        bounds.append(size)
        size *= 2
    return (*bounds, max_batch)


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class ServiceMetrics:
    """Requests by status, request latency, batch sizes, images and busy time of the batching worker."""

    def __init__(self, max_batch: int) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._responses: Counter[int] = Counter()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._latency_sum = 0.0
        self._latency_count = 0
        self._bucket_bounds = batch_size_buckets(max_batch)
        self._batch_bucket_counts = [0] * len(self._bucket_bounds)
        self._batch_images_sum = 0
        self._batches = 0
        self._padded_images = 0
        self._busy_s = 0.0
        self._dropped = 0
        self._recent_images: deque[tuple[float, int]] = deque()

    def record_response(self, status: int, latency_s: float | None = None) -> None:
        """One answered ``POST /v1/images``; ``latency_s`` for requests that got their images."""
        with self._lock:
            self._responses[status] += 1
            if latency_s is not None:
                self._latencies.append(latency_s)
                self._latency_sum += latency_s
                self._latency_count += 1

    def record_batch(self, images: int, run_size: int, seconds: float) -> None:
        """One finished batch of ``images`` requested images, sampled at batch size ``run_size``."""
        now = time.monotonic()
        with self._lock:
            self._batches += 1
            self._batch_images_sum += images
            self._padded_images += run_size - images
            self._busy_s += seconds
            for k, bound in enumerate(self._bucket_bounds):
                if images <= bound:
                    self._batch_bucket_counts[k] += 1
                    break
            self._recent_images.append((now, images))
            self._forget_old_images(now)

    def record_dropped(self, count: int = 1) -> None:
        """Requests whose client went away before their batch started (no sampling was done for them)."""
        with self._lock:
            self._dropped += count

    def _forget_old_images(self, now: float) -> None:
        while self._recent_images and self._recent_images[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent_images.popleft()

    def render(self, queue_depth: int, queued_images: int, device: torch.device) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric; GPU memory when ``device`` is CUDA."""
        now = time.monotonic()
        with self._lock:
            self._forget_old_images(now)
            window = min(THROUGHPUT_WINDOW_S, max(now - self._started, 1e-9))
            images_per_s = sum(n for _, n in self._recent_images) / window
            latencies = sorted(self._latencies)
            lines = [
                *gauge("fastdiff_queue_depth", "requests waiting for a batch", queue_depth),
                *gauge("fastdiff_queue_images", "images asked for by the waiting requests", queued_images),
                "# HELP fastdiff_requests_total answered POST /v1/images requests by HTTP status",
                "# TYPE fastdiff_requests_total counter",
                *(f'fastdiff_requests_total{{code="{code}"}} {n}' for code, n in sorted(self._responses.items())),
                *counter("fastdiff_requests_dropped_total", "clients gone before sampling", self._dropped),
                "# HELP fastdiff_request_latency_seconds time from arrival to images, recent answered requests",
                "# TYPE fastdiff_request_latency_seconds summary",
                *(
                    f'fastdiff_request_latency_seconds{{quantile="{q}"}} {number(quantile(latencies, q))}'
                    for q in LATENCY_QUANTILES
                ),
                f"fastdiff_request_latency_seconds_sum {number(self._latency_sum)}",
                f"fastdiff_request_latency_seconds_count {self._latency_count}",
                "# HELP fastdiff_batch_size requested images per sampled batch",
                "# TYPE fastdiff_batch_size histogram",
            ]
            cumulative = 0
            for bound, count in zip(self._bucket_bounds, self._batch_bucket_counts, strict=True):
                cumulative += count
                lines.append(f'fastdiff_batch_size_bucket{{le="{bound}"}} {cumulative}')
            lines += [
                f'fastdiff_batch_size_bucket{{le="+Inf"}} {self._batches}',
                f"fastdiff_batch_size_sum {self._batch_images_sum}",
                f"fastdiff_batch_size_count {self._batches}",
                *counter("fastdiff_images_total", "images sampled for requests", self._batch_images_sum),
                *counter("fastdiff_padding_images_total", "filler images that rounded batches up", self._padded_images),
                *counter("fastdiff_busy_seconds_total", "seconds the worker spent sampling", self._busy_s),
                *gauge("fastdiff_images_per_second", f"images in the last {THROUGHPUT_WINDOW_S:g} s", images_per_s),
            ]
        if device.type == "cuda":
            lines += [
                *gauge("fastdiff_gpu_memory_allocated_bytes", "torch tensors", torch.cuda.memory_allocated(device)),
                *gauge("fastdiff_gpu_memory_reserved_bytes", "torch cache", torch.cuda.memory_reserved(device)),
                *gauge("fastdiff_gpu_memory_peak_bytes", "peak allocated", torch.cuda.max_memory_allocated(device)),
            ]
        return "\n".join(lines) + "\n"


def number(value: float) -> str:
    """A sample value in Prometheus text: NaN as ``NaN``, integers without a fraction."""
    if math.isnan(value):
        return "NaN"
    return f"{value:.6g}" if not float(value).is_integer() else str(int(value))


def gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {number(value)}"]


def counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {number(value)}"]
