"""The FastAPI app of ``fastdiff serve``: ``create_app(model, max_batch=..., max_wait_ms=..., queue_size=...)``.

Routes: ``POST /v1/images`` (JSON with base64 PNGs and the prompt warnings, or ``image/png`` for one image),
``GET /v1/model``, ``GET /health``, ``GET /metrics`` (Prometheus text) and the browser page at ``/``. Serves
unconditional models and text-to-image models (SD-format directories, the bundled ``fashion-mnist-t2i``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from PIL import Image

from fastdiff.cli_args import DEFAULT_GUIDANCE, DEFAULT_MODEL, FULL_GUIDANCE, PAD_WAIT, resolve_dtype_choice
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError
from fastdiff.images import png_bytes
from fastdiff.models.stable_diffusion import prompt_warnings
from fastdiff.pipelines import Pipeline, TextToImagePipeline
from fastdiff.samplers import SAMPLERS
from fastdiff.serve.batcher import (
    Batcher,
    BatchKey,
    Job,
    JobResult,
    PipelineFactory,
    QueueFullError,
    ServiceStoppedError,
    TextInputs,
    is_text_pipeline,
)
from fastdiff.serve.metrics import ServiceMetrics
from fastdiff.serve.schema import (
    MAX_GUIDANCE,
    MAX_STEPS,
    ImageRequest,
    ModelInfo,
    PromptWarnings,
    RequestError,
    ResolvedRequest,
    parse_request,
    resolve_request,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
"""Longest request body read (a request is a few hundred bytes, or an img2img init image of a few MB)."""
MAX_SIDE_FACTOR = 2
"""A text-to-image model makes images up to this many times its default size along each side."""
CLIENT_CLOSED_REQUEST = 499
"""Status logged for a request whose client went away (nginx's convention; nobody receives it)."""


def pretrained_factory(model: str, device: str, dtype: str, plan: KernelPlan | None = None) -> PipelineFactory:
    """``factory(sampler, steps)`` loading ``model`` with ``Pipeline.from_pretrained`` (the engine on ``plan``)."""

    def load(sampler: str, steps: int) -> Pipeline:
        # A preset without weights gets random ones: seed them, so every (sampler, steps) pipeline and every
        # reload after eviction has the same weights (and the caller's random state is left alone).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return Pipeline.from_pretrained(model, device=device, dtype=dtype, sampler=sampler, steps=steps, plan=plan)

    return load


def describe_model(
    name: str,
    pipe: Pipeline | TextToImagePipeline,
    sampler: str,
    steps: int,
    max_batch: int,
    guidance: float = DEFAULT_GUIDANCE,
) -> ModelInfo:
    """The ``ModelInfo`` of a loaded pipeline; ``guidance``: the default of text-to-image requests."""
    shared = dict(samplers=tuple(SAMPLERS), default_sampler=sampler, default_steps=steps,
                  max_images_per_request=max_batch, max_steps=MAX_STEPS, device=str(pipe.device))  # fmt: skip
    if not is_text_pipeline(pipe):
        channels, height, width = pipe.sample_shape
        return ModelInfo(name=name, conditional=False, channels=channels, height=height, width=width, **shared)
    height, width = pipe.default_size
    # sides every U-Net level halves evenly (the engine runs them), in whole latents and multiples of 8
    multiple = math.lcm(8, pipe.vae_scale * 2 ** (len(pipe.unet.config.block_out_channels) - 1))
    return ModelInfo(
        name=name, conditional=True, channels=pipe.vae.config.out_channels, height=height, width=width, **shared,
        default_guidance=guidance, size_multiple=multiple,
        max_side=MAX_SIDE_FACTOR * max(height, width) // multiple * multiple, img2img=True,
    )  # fmt: skip


def prompt_checker(pipe: Pipeline | TextToImagePipeline) -> PromptWarnings | None:
    """``warnings(texts)`` on a text pipeline's tokenizer (requests are checked on the event loop while the worker
    tokenizes: fastdiff's ``CLIPTokenizer`` never changes its state, so both share it); None for pipelines without
    a tokenizer."""
    tokenizer = getattr(getattr(pipe, "components", None), "tokenizer", None)
    if not is_text_pipeline(pipe) or tokenizer is None:
        return None
    return lambda texts: prompt_warnings(tokenizer, texts)


def batch_key(request: ResolvedRequest) -> BatchKey:
    """Which requests ``request`` may share a batch with."""
    if request.guidance is None:  # unconditional
        return BatchKey(request.sampler, request.steps)
    interval = request.guidance_interval or FULL_GUIDANCE
    return BatchKey(request.sampler, request.steps, request.size, request.guidance > 1, request.strength, interval)


def text_inputs(request: ResolvedRequest) -> TextInputs | None:
    prompts = request.image_prompts()
    if prompts is None or request.guidance is None:
        return None
    return TextInputs(prompts, request.negative_prompt or "", request.guidance, request.init_image)


def encode_pngs(images: Sequence[Image.Image], parameters: Sequence[dict] | None = None) -> list[bytes]:
    """PNG bytes of each image, with its generation parameters (``fastdiff.images.png_info``)."""
    parameters = parameters or [None] * len(images)
    return [png_bytes(image, params) for image, params in zip(images, parameters, strict=True)]


def encode_base64_pngs(images: Sequence[Image.Image], parameters: Sequence[dict] | None = None) -> list[bytes]:
    """``encode_pngs``, each PNG as base64 (ASCII bytes, no newlines): what a JSON answer carries."""
    return [base64.b64encode(png) for png in encode_pngs(images, parameters)]


def images_json(body: dict, seeds: Sequence[int], base64_pngs: Sequence[bytes]) -> bytes:
    """The JSON answer: ``body`` plus ``"images": [{"seed": s, "png_base64": "..."}, ...]`` as its last member.

    The base64 text is spliced in as bytes (its alphabet needs no JSON escaping): ``json.dumps`` of a 1 MB string
    costs a few ms per image (4 ms for a 512x512 RGB answer on one CPU core), which a batch-1 answer pays in full."""
    head = json.dumps(body, allow_nan=False, separators=(",", ":")).encode("ascii")
    images = b",".join(
        b'{"seed":%d,"png_base64":"%s"}' % (seed, data) for seed, data in zip(seeds, base64_pngs, strict=True)
    )
    return head[:-1] + (b"," if body else b"") + b'"images":[' + images + b"]}"


def prefers_png(accept: str) -> bool:
    """``Accept`` names image/png and not application/json."""
    types = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    return "image/png" in types and "application/json" not in types


class BodyTooLargeError(Exception):
    """The request body is longer than ``MAX_BODY_BYTES`` (answered with 413)."""


async def read_body(request: Request) -> bytes:
    """The request body, read no further than ``MAX_BODY_BYTES``."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"the request body is over {MAX_BODY_BYTES} bytes")
    return bytes(body)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_for_job(batcher: Batcher, job: Job, request: Request) -> bool:
    """Wait for ``job`` or for the client to leave; True when the job finished. A job left behind is discarded."""
    finished = asyncio.wrap_future(job.future)
    client_gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({finished, client_gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone.cancel()
        if not job.future.done():
            batcher.discard(job)
    if finished.done() and not finished.cancelled():
        finished.exception()  # the caller reads the outcome from job.future; this marks the copy as seen
    return job.future.done() and not job.future.cancelled()


def create_app(
    model: str = DEFAULT_MODEL,
    *,
    pipeline_factory: PipelineFactory | None = None,
    device: str = "auto",
    dtype: str = "auto",
    sampler: str = "ddim",
    steps: int = 50,
    max_batch: int = 16,
    max_wait_ms: float = 10.0,
    queue_size: int = 64,
    batch_buckets: Sequence[int] | None = None,
    warmup: bool = False,
    plan: str | os.PathLike[str] | None = None,
    guidance: float = DEFAULT_GUIDANCE,
    pad_wait: float = PAD_WAIT,
    idle_start: bool = True,
) -> FastAPI:
    """The service for ``model`` (a preset or model directory; or any ``pipeline_factory(sampler, steps)``).

    ``sampler``/``steps`` (and ``guidance``, for text-to-image models) are the defaults of requests that name
    none. Batches hold at most ``max_batch`` images (also the per-request limit) and are sampled at the sizes
    ``batch_buckets`` (default: ``max_batch`` only, see ``fastdiff.serve.batcher``); a request waits at most
    ``max_wait_ms`` for company (a batch that would run padded up to ``pad_wait`` of a run longer; with
    ``idle_start``, none when the service is idle and no company is expected); more than
    ``queue_size`` waiting requests are answered with 429. ``warmup``
    samples every bucket size once before serving. ``plan``: a kernel plan file for the engine (``fastdiff tune``).
    """
    if sampler not in SAMPLERS:
        raise FastdiffError(f"unknown sampler {sampler!r}: use one of {', '.join(SAMPLERS)}")
    if not 1 <= steps <= MAX_STEPS:
        raise FastdiffError(f"steps must be in 1..{MAX_STEPS}, got {steps}")
    if not 0 <= guidance <= MAX_GUIDANCE:
        raise FastdiffError(f"guidance must be in 0..{MAX_GUIDANCE:g}, got {guidance}")
    kernel_plan = None if plan is None else KernelPlan.load(plan)  # a bad file: one line, before any model loads
    dtype = resolve_dtype_choice(dtype, device)
    served_dtype = {"dtype": dtype} if pipeline_factory is None else {}  # what each PNG records (a factory's: unknown)
    factory = pipeline_factory or pretrained_factory(model, device, dtype, kernel_plan)
    metrics = ServiceMetrics(max_batch)
    batcher = Batcher(factory, metrics, max_batch, max_wait_ms / 1000, queue_size, batch_buckets, pad_wait, idle_start)
    default_key = BatchKey(sampler, steps)
    pipe = batcher.pipeline(default_key)
    info = describe_model(model, pipe, sampler, steps, max_batch, guidance)
    check_prompts = prompt_checker(pipe)
    served_device = pipe.device  # the batcher owns the pipelines: no reference kept here
    if warmup:
        if info.conditional:
            default_key = BatchKey(sampler, steps, (info.height, info.width), guidance > 1)
        batcher.warmup(default_key, guidance)
    page = resources.files("fastdiff.serve").joinpath("page.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        log.info(
            "serving %s on %s: batches of up to %d images (run sizes %s)",
            model,
            served_device,
            max_batch,
            ",".join(map(str, batcher.buckets)),
        )
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="fastdiff", summary=f"diffusion sampling service for {model}", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.model_info = info

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.record_response(status)
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        waiting, _ = batcher.depth()
        status = "ok" if batcher.alive else "down"
        body = {"status": status, "model": model, "device": info.device, "queue_depth": waiting}
        return JSONResponse(body, status_code=200 if batcher.alive else 503)

    @app.get("/v1/model")
    async def model_info() -> dict:
        return info.to_json()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        text = metrics.render(*batcher.depth(), device=served_device)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    request_schema = {"content": {"application/json": {"schema": ImageRequest.model_json_schema()}}}

    @app.post("/v1/images", openapi_extra={"requestBody": request_schema})
    async def create_images(request: Request) -> Response:
        """Sample images; JSON with base64 PNGs, or the PNG itself for n = 1 with ``Accept: image/png``."""
        arrived = time.perf_counter()
        try:
            resolved = resolve_request(parse_request(await read_body(request)), info, check_prompts)
        except BodyTooLargeError as exc:
            return error(413, str(exc))
        except RequestError as exc:
            return error(422, str(exc))
        as_png = prefers_png(request.headers.get("accept", ""))
        if as_png and len(resolved.seeds) != 1:
            return error(406, "Accept: image/png answers with one image: ask for n = 1 or accept application/json")
        try:
            job = batcher.submit(batch_key(resolved), resolved.seeds, text_inputs(resolved))
        except QueueFullError as exc:
            return error(429, str(exc), headers={"Retry-After": "1"})
        except ServiceStoppedError as exc:
            return error(503, str(exc))
        if not await wait_for_job(batcher, job, request):
            return error(CLIENT_CLOSED_REQUEST, "the client closed the request")
        failure = job.future.exception()
        if isinstance(failure, FastdiffError):
            return error(422, str(failure))
        if isinstance(failure, ServiceStoppedError):
            return error(503, str(failure))
        if failure is not None:
            return error(500, f"sampling failed: {type(failure).__name__}: {failure}".splitlines()[0])
        result: JobResult = job.future.result()
        per_image = [params | served_dtype for params in resolved.image_parameters(model)]
        pngs = await asyncio.to_thread(encode_pngs if as_png else encode_base64_pngs, result.images, per_image)
        total_s = time.perf_counter() - arrived
        metrics.record_response(200, total_s)
        timing = {
            "queue_ms": round(result.queue_s * 1000, 3),
            "sample_ms": round(result.sample_s * 1000, 3),
            "total_ms": round(total_s * 1000, 3),
            "batch_images": result.batch_images,
            "run_batch_size": result.run_size,
        }
        if as_png:
            headers = {
                "X-Fastdiff-Seed": str(resolved.seeds[0]),
                "X-Fastdiff-Steps": str(resolved.steps),
                "X-Fastdiff-Sampler": resolved.sampler,
                "X-Fastdiff-Total-Ms": str(timing["total_ms"]),
            }
            if resolved.warnings:
                headers["X-Fastdiff-Warnings"] = json.dumps(resolved.warnings)  # ASCII: non-ASCII is escaped
            return Response(pngs[0], media_type="image/png", headers=headers)
        body = {"model": model, "parameters": resolved.parameters(), "warnings": resolved.warnings, "timing": timing}
        return Response(images_json(body, resolved.seeds, pngs), media_type="application/json")

    return app
