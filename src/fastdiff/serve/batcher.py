"""The batching worker: one thread owns the pipelines; requests wait in a bounded queue and leave in batches.

A batch starts from the oldest waiting request and takes, in arrival order, the waiting requests with the same
``BatchKey`` (sampler, steps; for text-to-image models also size, guided or not, and img2img strength) while their
images fit in ``max_batch``. It waits at most ``max_wait_s`` after the oldest request arrived for more company, and
starts at once when ``max_batch`` images are waiting. A batch that would run padded (fewer images than its run size,
below) waits longer, up to ``pad_wait`` times that run size's last sampling time, for requests that fill it: padding
costs a whole run for images thrown away, the wait at most that fraction of one. (SD 1.5 on the H100 with run sizes
1 and 8 and clients that send again as soon as they are answered: 8 clients got 5.1 images/s against 8.7 for 32,
the 8 clients' requests arriving a few ms apart and leaving in batches of 2-7 padded to 8.)

With ``idle_start`` (the default) a request that finds the service idle skips ``max_wait_s``: when the last batch
answered one request and none arrived while it ran, no company is expected (the clients that send again once
answered come back together with the ones they were batched with, or arrive while a batch runs), so the wait would
only add to the request's latency (5 ms: 4 % of an SD 1.5 image at batch 1). The first request after start is such a
request too. A batch that would run padded still waits up to ``pad_wait`` of a run.

Every batch is sampled at a fixed *run size* (the smallest of ``buckets`` that holds its images), padded with
filler images that are thrown away. Image k depends on seeds[k] only, but the float result of a kernel can depend
on the batch size (CPU GEMMs pick a different code path for 1, 2-3 and 4+ rows): with one bucket, every image is
sampled at the same batch size, so a request's images are byte-identical whether it ran alone or with others.
On CUDA each run size also captures its own graphs, so few sizes also means few captures.

Unconditional models get one pipeline per (sampler, steps). A text-to-image pipeline takes sampler and steps per
call, so the first one loaded serves every key; a batch runs it on one prompt, negative prompt, guidance scale and
seed per image (``num_images_per_prompt=1``), filler rows repeating the last image's.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from PIL import Image

from fastdiff.cli_args import DEFAULT_GUIDANCE, FULL_GUIDANCE, PAD_WAIT
from fastdiff.errors import FastdiffError
from fastdiff.pipelines import Pipeline, TextToImagePipeline
from fastdiff.serve.metrics import ServiceMetrics

log = logging.getLogger(__name__)

PipelineFactory = Callable[[str, int], Pipeline | TextToImagePipeline]
"""``factory(sampler, steps)`` -> a ready pipeline for that sampler and step count (a text-to-image pipeline takes
both per call: one is loaded, for the first key)."""

MAX_PIPELINES = 4
"""Pipelines kept loaded, least recently used dropped first (one per (sampler, steps) asked for); for a text model,
the kinds of batch (``BatchKey``) its one pipeline keeps prepared."""


class BatchKey(NamedTuple):
    """Requests with equal keys can share a batch. ``size`` (height, width), ``guided`` (guidance > 1),
    ``strength`` (img2img; None: text-to-image) and ``guidance_interval`` (the guided steps: one sampler table for
    the whole batch) are for text-to-image models."""

    sampler: str
    steps: int
    size: tuple[int, int] | None = None
    guided: bool = False
    strength: float | None = None
    guidance_interval: tuple[float, float] = FULL_GUIDANCE


@dataclass(frozen=True)
class TextInputs:
    """What a text-to-image request adds to its seeds: one prompt per image, and one negative prompt, guidance
    scale and init image (img2img, or None) for all of its images."""

    prompts: list[str]
    negative_prompt: str
    guidance: float
    init_image: Image.Image | None = None


def is_text_pipeline(pipe: object) -> bool:
    """Whether ``pipe`` is called with prompts (``TextToImagePipeline``) rather than a batch size."""
    return "prompt" in inspect.signature(pipe.__call__).parameters


class QueueFullError(RuntimeError):
    """The queue holds ``queue_size`` requests already (answered with 429)."""


class ServiceStoppedError(RuntimeError):
    """The worker stopped before the request ran."""


@dataclass
class JobResult:
    images: list[Image.Image]
    queue_s: float
    sample_s: float
    batch_images: int
    run_size: int


@dataclass(eq=False)
class Job:
    """One request's images: its future gets a ``JobResult`` (or the exception that sampling raised)."""

    key: BatchKey
    seeds: list[int]
    text: TextInputs | None = None
    future: Future = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.perf_counter)


def parse_buckets(buckets: Sequence[int] | None, max_batch: int) -> tuple[int, ...]:
    """Sorted run sizes, ending at ``max_batch``; ``None`` means the single size ``max_batch``."""
    if not buckets:
        return (max_batch,)
    bad = [b for b in buckets if not 1 <= b <= max_batch]
    if bad:
        raise FastdiffError(f"batch bucket {bad[0]} is outside 1..{max_batch} (the max batch)")
    return tuple(sorted({*buckets, max_batch}))


class Batcher:
    """The queue and the worker thread; ``submit`` from any thread, ``start``/``stop`` around serving."""

    def __init__(
        self,
        pipeline_factory: PipelineFactory,
        metrics: ServiceMetrics,
        max_batch: int,
        max_wait_s: float,
        queue_size: int,
        buckets: Sequence[int] | None = None,
        pad_wait: float = PAD_WAIT,
        idle_start: bool = True,
    ) -> None:
        if max_batch < 1 or queue_size < 1 or max_wait_s < 0 or not pad_wait >= 0:
            raise FastdiffError(
                f"max batch ({max_batch}) and queue size ({queue_size}) must be positive, max wait ({max_wait_s}) and "
                f"pad wait ({pad_wait}) >= 0"
            )
        self.pad_wait = pad_wait
        self.idle_start = idle_start
        self._arrivals = 0  # requests submitted so far
        self._company_expected = False  # the last batch answered several requests, or one arrived while it ran
        self._run_seconds: dict[int, float] = {}  # run size -> its last sampling time (warm-up or batch)
        self.pipeline_factory = pipeline_factory
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.queue_size = queue_size
        self.buckets = parse_buckets(buckets, max_batch)
        self._pipelines: OrderedDict[BatchKey, Pipeline] = OrderedDict()
        self._text_pipeline: TextToImagePipeline | None = None
        self._text_keys: OrderedDict[BatchKey, None] = OrderedDict()  # kinds of text batch prepared, oldest first
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ----- any thread -----

    def submit(self, key: BatchKey, seeds: list[int], text: TextInputs | None = None) -> Job:
        """Queue a request (``text``: its prompts etc., for a text-to-image model); ``QueueFullError`` when
        ``queue_size`` requests are waiting already."""
        if text is not None and len(text.prompts) != len(seeds):
            raise ValueError(f"{len(text.prompts)} prompts for {len(seeds)} seeds")
        job = Job(key, list(seeds), text)
        with self._cond:
            if self._stopping:
                raise ServiceStoppedError("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFullError(f"the queue is full ({self.queue_size} requests waiting): retry later")
            self._queue.append(job)
            self._arrivals += 1
            self._cond.notify()
        return job

    def discard(self, job: Job) -> None:
        """Forget a request whose client left: dropped if still waiting; if it is running, its result is unused."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                job.future.cancel()
                self.metrics.record_dropped()
                self._cond.notify()

    def depth(self) -> tuple[int, int]:
        """(requests waiting, images they ask for)."""
        with self._cond:
            return len(self._queue), sum(len(job.seeds) for job in self._queue)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the worker (again, after ``stop``: an app can be served more than once)."""
        with self._cond:
            self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="fastdiff-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the running batch, fail the waiting requests with ``ServiceStoppedError`` and join the thread."""
        with self._cond:
            self._stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServiceStoppedError("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ----- worker thread (or before start) -----

    def pipeline(self, key: BatchKey) -> Pipeline | TextToImagePipeline:
        """The pipeline for ``key``, loaded on first use (at most ``MAX_PIPELINES`` kept); a text-to-image
        pipeline, once loaded, serves every key."""
        if self._text_pipeline is not None:
            self._prepare_text_key(key)
            return self._text_pipeline
        full_key, key = key, BatchKey(key.sampler, key.steps)
        pipe = self._pipelines.get(key)
        if pipe is None:
            log.info("loading a pipeline for sampler %s, %d steps", key.sampler, key.steps)
            pipe = self.pipeline_factory(key.sampler, key.steps)
            if is_text_pipeline(pipe):
                self._pipelines.clear()
                self._text_pipeline = pipe
                self._prepare_text_key(full_key)
                return pipe
            self._pipelines[key] = pipe
            while len(self._pipelines) > MAX_PIPELINES:
                self._pipelines.popitem(last=False)
        self._pipelines.move_to_end(key)
        return pipe

    def _prepare_text_key(self, key: BatchKey) -> None:
        """Count ``key`` among the kinds of batch the text pipeline holds prepared (samplers, CUDA graphs, fused
        forwards per size): past ``MAX_PIPELINES`` kinds, drop them all (the next batch of each kind rebuilds), so
        requests asking for ever new sizes or step counts cannot grow memory without bound."""
        self._text_keys.pop(key, None)
        self._text_keys[key] = None
        if len(self._text_keys) <= MAX_PIPELINES:
            return
        log.info("more than %d kinds of text batch: dropping the prepared samplers and graphs", MAX_PIPELINES)
        self._text_pipeline.clear_prepared()
        self._text_keys = OrderedDict({key: None})

    def run_size(self, images: int) -> int:
        """The batch size a batch of ``images`` images is sampled at."""
        return next(b for b in self.buckets if b >= images)

    def warmup(self, key: BatchKey, guidance: float = DEFAULT_GUIDANCE) -> None:
        """Sample once at every run size (CUDA: captures the graphs before the first request), then once more to
        time each (``pad_wait``'s unit); a text model samples the empty prompt at ``guidance``."""
        pipe = self.pipeline(key)
        for timed in (False, True):
            for size in self.buckets:
                start = time.perf_counter()
                seeds = list(range(size))
                if is_text_pipeline(pipe):
                    text = TextInputs([""] * size, "", guidance)
                    self._sample_text(pipe, key, [Job(key, seeds, text)], seeds, size, "tensor")
                else:
                    pipe(batch_size=size, seeds=seeds, output_type="tensor", progress=False)
                if timed:
                    self._run_seconds[size] = time.perf_counter() - start
                else:
                    log.info("warm-up at batch %d: %.2f s", size, time.perf_counter() - start)

    def _serve(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                return
            try:
                self._run_batch(jobs)
            except Exception as exc:  # anything that escaped _run_batch: fail the batch, keep serving
                log.exception("batch failed")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _next_batch(self) -> list[Job] | None:
        """Wait for a batch (see the module docstring); its jobs are marked running. None once stopping."""
        with self._cond:
            while True:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return None
                head = self._queue[0]
                alone = self.idle_start and not self._company_expected and len(self._queue) == 1
                deadline = head.enqueued_at + (0.0 if alone else self.max_wait_s)
                while not self._stopping and self._queue and self._queue[0] is head:
                    waiting = self._images_waiting(head.key)
                    if waiting >= self.max_batch:
                        break
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:  # padded? then wait for more, up to pad_wait of a run (module docstring)
                        run = self.run_size(waiting)
                        extra = self.pad_wait * self._run_seconds.get(run, 0.0)
                        remaining = deadline + extra - time.perf_counter() if waiting < run else 0.0
                        if remaining <= 0:
                            break
                    self._cond.wait(remaining)
                if self._stopping:
                    return None
                if not self._queue or self._queue[0] is not head:
                    continue  # the oldest request left while we waited: start over from the new oldest
                taken = self._take(head.key)
                jobs = [job for job in taken if job.future.set_running_or_notify_cancel()]
                if len(jobs) < len(taken):
                    self.metrics.record_dropped(len(taken) - len(jobs))
                if jobs:
                    return jobs

    def _images_waiting(self, key: BatchKey) -> int:
        return sum(len(job.seeds) for job in self._queue if job.key == key)

    def _take(self, key: BatchKey) -> list[Job]:
        """Remove and return the oldest waiting jobs with ``key`` that fit in ``max_batch`` (in arrival order)."""
        taken: list[Job] = []
        images = 0
        for job in self._queue:
            if job.key != key:
                continue
            if images + len(job.seeds) > self.max_batch:
                break
            taken.append(job)
            images += len(job.seeds)
        for job in taken:
            self._queue.remove(job)
        return taken

    def _run_batch(self, jobs: list[Job]) -> None:
        key = jobs[0].key
        seeds = [seed for job in jobs for seed in job.seeds]
        run_size = self.run_size(len(seeds))
        padded = seeds + [seeds[-1]] * (run_size - len(seeds))
        with self._cond:
            arrivals = self._arrivals
        start = time.perf_counter()
        try:
            pipe = self.pipeline(key)
            if is_text_pipeline(pipe):
                images = self._sample_text(pipe, key, jobs, padded, run_size, "pil")
            else:
                images = pipe(batch_size=run_size, seeds=padded, output_type="pil", progress=False)
        except Exception as exc:
            if not isinstance(exc, FastdiffError):  # e.g. steps beyond the model's schedule: the user's error
                log.exception("sampling a batch of %d failed", len(seeds))
            for job in jobs:
                job.future.set_exception(exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            return
        sample_s = time.perf_counter() - start
        with self._cond:
            self._company_expected = len(jobs) > 1 or self._arrivals > arrivals
        self._run_seconds[run_size] = sample_s
        self.metrics.record_batch(len(seeds), run_size, sample_s)
        log.debug("batch of %d (run at %d) for %d requests: %.3f s", len(seeds), run_size, len(jobs), sample_s)
        offset = 0
        for job in jobs:
            count = len(job.seeds)
            job.future.set_result(
                JobResult(
                    images=images[offset : offset + count],
                    queue_s=start - job.enqueued_at,
                    sample_s=sample_s,
                    batch_images=len(seeds),
                    run_size=run_size,
                )
            )
            offset += count

    @staticmethod
    def _sample_text(
        pipe: TextToImagePipeline, key: BatchKey, jobs: list[Job], seeds: list[int], run_size: int, output_type: str
    ) -> list[Image.Image] | torch.Tensor:
        """One text-to-image call: a row (prompt, negative prompt, guidance, init image) per image of ``jobs``,
        padded to ``run_size`` rows by repeating the last."""
        rows = [
            (prompt, job.text.negative_prompt, job.text.guidance, job.text.init_image)
            for job in jobs
            if job.text is not None
            for prompt in job.text.prompts
        ]
        if len(rows) != sum(len(job.seeds) for job in jobs):
            raise FastdiffError("a text-to-image model needs a prompt for every image")
        rows += [rows[-1]] * (run_size - len(rows))
        prompts, negatives, scales, init_images = (list(column) for column in zip(*rows, strict=True))
        height, width = key.size if key.size is not None else (None, None)
        img2img = key.strength is not None
        return pipe(
            prompt=prompts,
            negative_prompt=negatives,
            guidance_scale=scales,
            height=height,
            width=width,
            num_images_per_prompt=1,
            seeds=seeds,
            steps=key.steps,
            sampler=key.sampler,
            image=init_images if img2img else None,
            **({"strength": key.strength} if img2img else {}),
            output_type=output_type,
            progress=False,
            guidance_interval=key.guidance_interval,
        )
