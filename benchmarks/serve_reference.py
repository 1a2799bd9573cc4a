"""A plain reference server for `fastdiff loadtest`: diffusers' StableDiffusionPipeline behind the routes of
`fastdiff serve`, one request at a time. Written for scripts/gpu_loadtest_t2i.sh, which loads both servers from one
directory (the same weights) and compares them under the same load.

    python benchmarks/serve_reference.py write-sd DIR [--preset sd15] [--seed 0]
    python benchmarks/serve_reference.py serve --model DIR [--port 8766] [--device cuda] [--dtype fp16] \\
        [--steps 20] [--guidance 7.5] [--max-images 8] [--no-compile]

``write-sd``: a random-weight Stable Diffusion directory (``fastdiff.models.stable_diffusion.random_components``:
the preset's architecture, fastdiff's byte-level CLIP tokenizer, fp16 safetensors) that diffusers and
``fastdiff serve --model DIR`` both load.

``serve``: ``POST /v1/images`` (JSON in, JSON with base64 PNGs out, as fastdiff serve; text requests only: no
``init_image``, sampler "ddim" only), ``GET /v1/model``, ``GET /health`` and a small ``GET /metrics`` (queue depth,
torch GPU memory under fastdiff serve's gauge names). Requests are parsed and checked by fastdiff serve's schema,
and the PNGs are encoded by the same function with the same parameters, so only the sampling differs: diffusers'
pipeline with ``DDIMScheduler.from_config`` of the directory's scheduler config, one seeded generator per image, the
U-Net under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` in channels-last memory (as ``fastdiff bench``'s
diffusers+compile; ``--no-compile`` for CPU tests). Every pipeline call, the warm-up included, runs on one worker
thread (one request at a time; CUDA graphs are recorded per thread); the others wait in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import logging
import math
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from fastdiff.errors import FastdiffError
from fastdiff.images import png_bytes
from fastdiff.serve.metrics import gauge
from fastdiff.serve.schema import MAX_STEPS, ModelInfo, RequestError, ResolvedRequest, parse_request, resolve_request

log = logging.getLogger("serve_reference")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SAMPLER = "ddim"
MAX_SIDE_FACTOR = 2
"""Largest side: this many times the default (as fastdiff serve)."""
WARMUP_CALLS = 3
"""Pipeline calls before serving: the first compiles the U-Net, the next ones record and replay its CUDA graphs."""


def init_cudagraph_tls() -> None:
    """Give this thread the CUDA-graph tree state of ``torch.compile(mode="reduce-overhead")``: Inductor keeps it in
    a ``threading.local`` set up only on the thread that imported ``torch._inductor.cudagraph_trees``, and torch
    releases before that set-up moved into ``get_obj`` fail with a bare ``assert torch._C._is_key_in_tls(...)`` on
    any other thread. Run first on the worker thread (the executor's initializer)."""
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:
        return
    local = getattr(trees, "local", None)
    if local is None or hasattr(local, "tree_manager_containers"):
        return
    if hasattr(trees, "_initialize_tls"):
        trees._initialize_tls(local)
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


def import_diffusers() -> Any:
    try:
        import diffusers
    except ImportError:
        raise FastdiffError(
            "the reference server needs diffusers: pip install diffusers (or the .whl/ wheels)"
        ) from None
    return diffusers


# ----- a random-weight Stable Diffusion directory -----


def write_sd_directory(root: Path, comps: Any, dtype: torch.dtype = torch.float16) -> Path:
    """Write fastdiff ``StableDiffusionComponents`` as a diffusers ``StableDiffusionPipeline`` directory at ``root``
    (model_index.json, unet/ and vae/ as diffusers configs + safetensors, text_encoder/ in transformers' layout,
    tokenizer/, scheduler/), weights in ``dtype``."""
    from fastdiff.models.clip_text import save_clip_text
    from fastdiff.models.stable_diffusion import clip_tokenizer_files
    from fastdiff.train.text_to_image.files import DIFFUSERS_VERSION, MODEL_INDEX, write_diffusers_model

    root = Path(root)
    if (root / "model_index.json").exists():
        raise FastdiffError(f"{root} already holds a pipeline: remove it or pick another directory")
    root.mkdir(parents=True, exist_ok=True)
    scheduler = dict(comps.scheduler_config)
    scheduler.setdefault("_diffusers_version", DIFFUSERS_VERSION)
    index = {**MODEL_INDEX, "scheduler": ["diffusers", scheduler["_class_name"]]}
    (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
    tokenizer = comps.tokenizer
    (root / "tokenizer").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        saved = {path.name: path.read_bytes() for path in Path(tmp).iterdir() if path.is_file()}
    if not saved:  # a tokenizer that cannot save itself: fastdiff's byte-level CLIP files
        pad = tokenizer.pad_token or "<|endoftext|>"
        saved = {k: v.encode() for k, v in clip_tokenizer_files([], pad, tokenizer.model_max_length).items()}
    for name, data in saved.items():
        (root / "tokenizer" / name).write_bytes(data)
    save_clip_text(comps.text_encoder, root / "text_encoder", dtype)
    write_diffusers_model(root / "unet", comps.unet, "UNet2DConditionModel", dtype)
    write_diffusers_model(root / "vae", comps.vae, "AutoencoderKL", dtype)
    return root


def write_random_sd(root: Path, preset: str = "sd15", seed: int = 0, dtype: torch.dtype = torch.float16) -> Path:
    """A random-weight ``preset`` (``SD_PRESETS``) directory at ``root`` (see ``write_sd_directory``), its weights
    drawn on the GPU where there is one."""
    from fastdiff.models.stable_diffusion import random_components

    start = time.perf_counter()
    comps = random_components(preset, seed, "cuda" if torch.cuda.is_available() else "cpu")
    path = write_sd_directory(root, comps, dtype)
    log.info("wrote a random %s at %s in %.1f s", preset, path, time.perf_counter() - start)
    return path


# ----- the server -----


class ReferenceSampler:
    """diffusers' StableDiffusionPipeline (DDIM) on one worker thread."""

    def __init__(
        self, model: str, device: str, dtype: str, compile_unet: bool, max_images: int, steps: int, guidance: float
    ) -> None:
        diffusers = import_diffusers()
        self.device = torch.device(device)
        self.compiled = compile_unet
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="reference-sampler",
            initializer=init_cudagraph_tls if compile_unet else None,
        )
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            model, torch_dtype=DTYPES[dtype], safety_checker=None, requires_safety_checker=False
        )
        pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)
        if compile_unet:
            self.pipe.unet.to(memory_format=torch.channels_last)
            self.pipe.unet = torch.compile(self.pipe.unet, mode="reduce-overhead", fullgraph=True)
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        side = pipe.unet.config.sample_size * vae_scale
        multiple = math.lcm(8, vae_scale * 2 ** (len(pipe.unet.config.block_out_channels) - 1))
        self.info = ModelInfo(
            name=model,
            conditional=True,
            channels=pipe.vae.config.out_channels,
            height=side,
            width=side,
            samplers=(SAMPLER,),
            default_sampler=SAMPLER,
            default_steps=steps,
            max_images_per_request=max_images,
            max_steps=MAX_STEPS,
            device=str(self.device),
            default_guidance=guidance,
            size_multiple=multiple,
            max_side=MAX_SIDE_FACTOR * side // multiple * multiple,
            img2img=False,
        )
        # requests are checked on the event loop while the worker tokenizes: a second tokenizer, as fastdiff serve
        self.tokenizer = type(pipe.tokenizer).from_pretrained(str(Path(model) / "tokenizer"), local_files_only=True)

    def warnings(self, texts: list[str]) -> list[str]:
        from fastdiff.models.stable_diffusion import prompt_warnings

        return prompt_warnings(self.tokenizer, texts)

    def sample(self, request: ResolvedRequest) -> list:
        """The request's images (PIL), one seeded generator per image (runs on the worker thread)."""
        prompts = request.image_prompts() or []
        generators = [torch.Generator(self.device).manual_seed(seed) for seed in request.seeds]
        height, width = request.size
        negative = [request.negative_prompt] * len(prompts) if request.negative_prompt else None
        return self.pipe(
            prompt=prompts,
            negative_prompt=negative,
            height=height,
            width=width,
            num_inference_steps=request.steps,
            guidance_scale=request.guidance,
            generator=generators,
            output_type="pil",
        ).images

    def warmup(self, calls: int = WARMUP_CALLS) -> None:
        """Sample one image of the default size ``calls`` times on the worker thread."""
        info = self.info
        request = ResolvedRequest(
            seeds=[0], steps=info.default_steps, sampler=SAMPLER, prompt="", negative_prompt=None,
            guidance=info.default_guidance, size=(info.height, info.width),
        )  # fmt: skip
        for k in range(calls):
            start = time.perf_counter()
            self.executor.submit(self.sample, request).result()
            log.info("warm-up call %d: %.2f s", k + 1, time.perf_counter() - start)


def create_reference_app(
    model: str,
    *,
    device: str = "cuda",
    dtype: str = "fp16",
    compile_unet: bool = True,
    steps: int = 20,
    guidance: float = 7.5,
    max_images: int = 8,
    warmup: bool = True,
) -> FastAPI:
    """The reference service for the Stable Diffusion directory ``model`` (see the module docstring)."""
    if dtype not in DTYPES:
        raise FastdiffError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if not (Path(model) / "model_index.json").is_file():
        raise FastdiffError(f"{model} is not a Stable Diffusion pipeline directory (no model_index.json)")
    sampler = ReferenceSampler(model, device, dtype, compile_unet, max_images, steps, guidance)
    if warmup:
        sampler.warmup()
    info = sampler.info
    waiting = 0
    lock = threading.Lock()
    stopped = threading.Event()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("reference server for %s on %s (compiled U-Net: %s)", model, info.device, compile_unet)
        try:
            yield
        finally:
            stopped.set()
            await asyncio.to_thread(sampler.executor.shutdown, True, cancel_futures=True)

    app = FastAPI(
        title="fastdiff reference", summary=f"diffusers StableDiffusionPipeline for {model}", lifespan=lifespan
    )
    app.state.sampler = sampler

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = not stopped.is_set()
        body = {"status": "ok" if alive else "down", "model": model, "device": info.device, "queue_depth": waiting}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/model")
    async def model_info() -> dict:
        return info.to_json()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        lines = gauge("fastdiff_queue_depth", "requests waiting for the worker", waiting)
        if sampler.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(sampler.device)
            lines += gauge("fastdiff_gpu_memory_allocated_bytes", "torch tensors", allocated)
            lines += gauge(
                "fastdiff_gpu_memory_reserved_bytes", "torch cache", torch.cuda.memory_reserved(sampler.device)
            )
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/images")
    async def create_images(request: Request) -> JSONResponse:
        nonlocal waiting
        arrived = time.perf_counter()
        try:
            parsed = parse_request(await request.body())
            if parsed.init_image is not None:
                raise RequestError("the reference server answers text requests only: no init_image")
            resolved = resolve_request(parsed, info, sampler.warnings)
        except RequestError as exc:
            return error(422, str(exc))
        started: list[float] = []  # when the worker took the request

        def run() -> list:
            nonlocal waiting
            with lock:
                waiting -= 1
            started.append(time.perf_counter())
            return sampler.sample(resolved)

        with lock:
            waiting += 1
        try:
            images = await asyncio.wrap_future(sampler.executor.submit(run))
        except (RuntimeError, asyncio.CancelledError) as exc:  # the worker shut down (a sampling RuntimeError ran)
            if not started:
                with lock:
                    waiting -= 1
                return error(503, "the server is shutting down")
            return error(500, f"sampling failed: {type(exc).__name__}: {exc}".splitlines()[0])
        except Exception as exc:
            return error(500, f"sampling failed: {type(exc).__name__}: {exc}".splitlines()[0])
        sample_s = time.perf_counter() - started[0]
        per_image = [params | {"dtype": dtype} for params in resolved.image_parameters(model)]  # as fastdiff serve's
        pngs = await asyncio.to_thread(lambda: [png_bytes(im, p) for im, p in zip(images, per_image, strict=True)])
        total_s = time.perf_counter() - arrived
        timing = {
            "queue_ms": round((started[0] - arrived) * 1000, 3),
            "sample_ms": round(sample_s * 1000, 3),
            "total_ms": round(total_s * 1000, 3),
            "batch_images": len(images),
            "run_batch_size": len(images),
        }
        body = {
            "model": model,
            "parameters": resolved.parameters(),
            "warnings": resolved.warnings,
            "timing": timing,
            "images": [
                {"seed": seed, "png_base64": base64.b64encode(png).decode("ascii")}
                for seed, png in zip(resolved.seeds, pngs, strict=True)
            ],
        }
        return JSONResponse(body)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write-sd", help="write a random-weight Stable Diffusion directory")
    write.add_argument("dir", type=Path)
    write.add_argument("--preset", default="sd15")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--dtype", default="fp16", choices=DTYPES)
    serve = commands.add_parser("serve", help="serve a Stable Diffusion directory with diffusers")
    serve.add_argument("--model", required=True, help="StableDiffusionPipeline directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8766)
    serve.add_argument("--device", default="cuda")
    serve.add_argument("--dtype", default="fp16", choices=DTYPES)
    serve.add_argument("--steps", type=int, default=20, help="steps of requests that name none")
    serve.add_argument("--guidance", type=float, default=7.5, help="guidance of requests that name none")
    serve.add_argument("--max-images", type=int, default=8, help="images per request at most")
    serve.add_argument("--no-compile", action="store_true", help="eager U-Net (CPU tests)")
    serve.add_argument("--no-warmup", action="store_true", help="serve before sampling once")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "write-sd":
            write_random_sd(args.dir, args.preset, args.seed, DTYPES[args.dtype])
            return 0
        import uvicorn

        app = create_reference_app(
            args.model, device=args.device, dtype=args.dtype, compile_unet=not args.no_compile, steps=args.steps,
            guidance=args.guidance, max_images=args.max_images, warmup=not args.no_warmup,
        )  # fmt: skip
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    except FastdiffError as exc:
        print(f"serve_reference: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
