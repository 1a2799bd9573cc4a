"""``TextToImagePipeline``: Stable Diffusion 1.x / 2.x text-to-image and image-to-image sampling.

Equal to diffusers' ``StableDiffusionPipeline`` (and ``StableDiffusionImg2ImgPipeline`` when ``image`` is given)
with the scheduler that matches the sampler: the same prompt encoding, classifier-free guidance, initial noise
scaling, img2img start step and VAE decode. Differences are in how the work is done: each distinct prompt is
encoded once; with guidance the U-Net runs once per step on the batch [x; x] against [uncond; cond] text states
and the sampler's fused step combines the halves; all noise is fastdiff's seeded counter-based noise
(``fastdiff.samplers.noise``), so image b depends on ``seeds[b]`` only.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastdiff.cli_args import DEFAULT_GUIDANCE
from fastdiff.devices import host_to_device, resolve_device, resolve_dtype, synchronize, warn_slow_dtype
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError
from fastdiff.images import to_pil
from fastdiff.models import step_cache
from fastdiff.models.autoencoder_kl import AutoencoderKLConfig
from fastdiff.models.stable_diffusion import (
    StableDiffusionComponents,
    encode_prompts,
    is_random_preset,
    load_stable_diffusion,
    log_prompt_warnings,
    resolve_pipeline_dir,
)
from fastdiff.pipelines.base import (
    FP8,
    EnginePipeline,
    check_fp8,
    check_output_type,
    expand_seeds,
    load_plan,
    resolve_backend,
    warn_if_nonfinite,
)
from fastdiff.pipelines.guidance_parallel import GuidanceSplit
from fastdiff.pipelines.patch_parallel import DEFAULT_WARMUP, PatchSplit
from fastdiff.samplers import (
    FULL_GUIDANCE,
    SAMPLERS,
    Sampler,
    ScheduleConfig,
    check_guidance_interval,
    initial_noise,
    make_sampler,
    run_sampler,
    seed_tensor,
)
from fastdiff.samplers.noise import draw

log = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "tensor")
SIZE_MULTIPLE = 8
"""Image sides must be multiples of this (diffusers' ``check_inputs``); pixels per latent: ``vae_scale_factor``."""
TEXT_CACHE_SIZE = 256
"""Texts whose encoder states a pipeline keeps (least recently used dropped first)."""
ENCODE_COUNTER = 2**31 - 1
"""The ``fastdiff.samplers.noise`` draw that samples image b's VAE posterior in img2img (steps use draws 1..N)."""

InitImage = Image.Image | list[Image.Image] | np.ndarray | torch.Tensor
"""What img2img starts from: PIL image(s), or [0, 1] pixels as [B,] H, W, 3 arrays or [B,] 3, H, W tensors."""


def is_text_to_image_dir(path: str | Path) -> bool:
    """Whether ``path`` is a diffusers pipeline directory (it has model_index.json), a bundled text-to-image preset
    name (``fastdiff.models.stable_diffusion.BUNDLED_PIPELINES``) or a random-weight Stable Diffusion preset ("sd15",
    "sd21"), not a U-Net or unconditional preset."""
    return is_random_preset(path) or (resolve_pipeline_dir(path) / "model_index.json").is_file()


def check_size(height: int | None, width: int | None) -> None:
    """Height and width (where given) must be positive multiples of 8."""
    for name, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0 or value % SIZE_MULTIPLE:
            raise FastdiffError(f"{name} must be a positive multiple of {SIZE_MULTIPLE}, got {value!r}")


def vae_scale_factor(vae_config: AutoencoderKLConfig) -> int:
    """Pixels per latent along each side: 2 ** (levels - 1), as diffusers' pipelines compute it (8 for SD's VAE)."""
    return 2 ** (len(vae_config.block_out_channels) - 1)


def guidance_scales(guidance_scale: float | Sequence[float], prompts: int) -> list[float]:
    """One classifier-free guidance scale per prompt from one scale or a list of ``prompts`` scales: finite, >= 0,
    and all guided (> 1) or all unguided (<= 1, the conditional model alone)."""
    scales = list(guidance_scale) if isinstance(guidance_scale, (list, tuple)) else [guidance_scale] * prompts
    if len(scales) != prompts:
        raise FastdiffError(f"guidance_scale must be one number or one per prompt ({prompts}), got {guidance_scale!r}")
    for scale in scales:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale < 0:
            raise FastdiffError(f"guidance_scale must be a finite number >= 0 (<= 1: no guidance), got {scale!r}")
    if len({scale > 1 for scale in scales}) > 1:
        raise FastdiffError(
            "guidance scales mix guided (> 1) and unguided (<= 1) prompts: sample them in separate calls"
        )
    return [float(scale) for scale in scales]


def check_strength(strength: float) -> None:
    """img2img strength must be in (0, 1]."""
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not 0 < strength <= 1:
        raise FastdiffError(f"strength must be in (0, 1], got {strength!r}")


def start_step(steps: int, strength: float) -> int:
    """The first of ``steps`` sampler steps that img2img runs (diffusers' ``get_timesteps``)."""
    init_timestep = min(int(steps * strength), steps)
    if init_timestep == 0:
        raise FastdiffError(f"strength {strength} leaves none of the {steps} steps to run: raise strength or steps")
    return max(steps - init_timestep, 0)


def image_batch(image: InitImage) -> torch.Tensor:
    """An init image (PIL image, list of them, [H, W, 3] / [B, H, W, 3] numpy array or [3, H, W] / [B, 3, H, W]
    tensor, values in [0, 1]) as fp32 [B, 3, H, W] in [-1, 1], as diffusers' ``VaeImageProcessor.preprocess``."""
    if isinstance(image, Image.Image):
        image = [image]
    if isinstance(image, list) and image and all(isinstance(i, Image.Image) for i in image):
        sizes = {i.size for i in image}
        if len(sizes) != 1:
            raise FastdiffError(f"init images differ in size: {sorted(sizes)}")
        pixels = np.stack([np.asarray(i.convert("RGB"), dtype=np.float32) / 255.0 for i in image])
        batch = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
    elif isinstance(image, np.ndarray) and image.ndim in (3, 4) and image.shape[-1] == 3:
        batch = torch.from_numpy(np.asarray(image, dtype=np.float32)).reshape(-1, *image.shape[-3:])
        batch = batch.permute(0, 3, 1, 2).contiguous()
    elif isinstance(image, torch.Tensor) and image.ndim in (3, 4) and image.shape[-3] == 3:
        batch = image.detach().to("cpu", torch.float32).reshape(-1, *image.shape[-3:]).contiguous()
    else:
        kind = type(image).__name__ if not hasattr(image, "shape") else f"{type(image).__name__} {tuple(image.shape)}"
        raise FastdiffError(
            f"image must be a PIL image, a list of them, an [H, W, 3] numpy array or a [3, H, W] tensor; got {kind}"
        )
    if not torch.isfinite(batch).all() or batch.min() < 0 or batch.max() > 1:
        raise FastdiffError("image values must be in [0, 1]")
    height, width = batch.shape[-2:]
    if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE:
        raise FastdiffError(f"image size {width}x{height} is not a multiple of {SIZE_MULTIPLE}: crop or resize it")
    return batch * 2 - 1


class TextToImagePipeline(EnginePipeline):
    """Stable Diffusion components plus a sampler. ``pipe("a cat", seeds=0)`` returns images; see ``__call__``.

    The sampler state stays in fp32 whatever the model dtype; U-Net, VAE and text encoder run in ``dtype``.
    ``fp8``: the engine's fp8 mode for the U-Net (``dtype`` fp16 or bf16 activations, the convs after each
    GroupNorm in e4m3: ``fastdiff.engine.Engine(fp8=True)``; a Hopper GPU or Triton's interpreter).
    """

    def __init__(
        self,
        components: StableDiffusionComponents,
        sampler: str = "ddim",
        steps: int = 50,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        karras: bool | None = None,
        backend: str | None = None,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
        fp8: bool = False,
    ) -> None:
        if fp8:
            backend = check_fp8(torch.device(device), dtype, backend)
        super().__init__(device, backend, fp8, plan=plan, tune=tune)
        if fp8:
            from fastdiff.engine.lower import lowering_for

            lowering_for(components.unet)  # a one-line error for a U-Net the fused engine cannot run
        self.components = components
        self.unet, self.vae = components.unet, components.vae
        self.vae_scale = vae_scale_factor(self.vae.config)
        self.schedule = ScheduleConfig.from_diffusers(components.scheduler_config)
        self.sampler_name = sampler
        self.steps = steps
        self.dtype = dtype
        self.karras = karras
        self._samplers: dict[tuple[str, int, int, float], Sampler] = {}
        self._text_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.guidance_split: GuidanceSplit | None = None
        """Set by ``split_guidance``: guided calls run half of each U-Net call in this process."""
        self.patch_split: PatchSplit | None = None
        """Set by ``split_patches``: every U-Net call runs on this process's band of the latent."""
        self.last_prompt_warnings: list[str] = []
        """The last call's prompt warnings (``encode_prompts``: unknown words, truncation), one line each."""
        self.load_timings: dict[str, float] = {}
        """``from_pretrained``'s phases in seconds: reading the files (``read_s``), moving the text encoder and VAE
        to the device (``to_device_s``, the first CUDA call included) and the pipeline's own set-up (``setup_s``)."""
        self.sampler_for(sampler, steps)  # validates the name and step count now, not at the first call

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "fp32",
        sampler: str = "ddim",
        steps: int = 50,
        karras: bool | None = None,
        backend: str | None = None,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
    ) -> TextToImagePipeline:
        """Load a local diffusers ``StableDiffusionPipeline`` directory or a bundled text-to-image preset name
        (e.g. "fashion-mnist-t2i"; ``load_stable_diffusion``).

        ``dtype``: "fp32", "fp16", "bf16" or "fp8": the engine's fp8 mode for the U-Net (fp16 activations, e4m3
        convs after each GroupNorm: ``fastdiff.engine.Engine(fp8=True)``; a Hopper GPU); the text encoder and the
        VAE run in fp16 then.

        ``karras``: Karras sigma spacing for the samplers that offer it (default: as the scheduler config says).
        """
        if sampler not in SAMPLERS:
            raise FastdiffError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
        plan = load_plan(plan)  # a bad plan file fails before the weights load
        dev = resolve_device(device)
        fp8 = dtype == FP8
        torch_dtype = torch.float16 if fp8 else resolve_dtype(dtype)
        backend = check_fp8(dev, torch_dtype, backend) if fp8 else resolve_backend(backend, dev)
        warn_slow_dtype(dev, torch_dtype)
        # the engine streams the U-Net's weights from host memory and packs them on the GPU: the module stays on the CPU
        t0 = time.perf_counter()
        components = load_stable_diffusion(
            path, device="cpu" if backend == "engine" else dev, dtype=torch_dtype, draw_device=dev
        )
        t1 = time.perf_counter()
        if backend == "engine":
            components.text_encoder.to(dev)
            components.vae.to(dev)
        synchronize(dev)
        t2 = time.perf_counter()
        pipe = cls(
            components, sampler=sampler, steps=steps, device=dev, dtype=torch_dtype, karras=karras, backend=backend,
            plan=plan, tune=tune, fp8=fp8,
        )  # fmt: skip
        synchronize(dev)
        pipe.load_timings = {"read_s": t1 - t0, "to_device_s": t2 - t1, "setup_s": time.perf_counter() - t2}
        return pipe

    def uses_engine(self, latent_shape: tuple[int, int, int]) -> bool:
        """Whether a call at ``latent_shape`` runs on the engine: backend "engine" and latent sides that every
        U-Net level halves evenly (other sizes run eagerly, as diffusers matches odd skip sizes)."""
        factor = 2 ** (len(self.unet.config.block_out_channels) - 1)
        fits = latent_shape[1] % factor == 0 and latent_shape[2] % factor == 0
        if self.backend == "engine" and not fits:
            log.info("latents %s are not multiples of %d: this call runs eagerly", latent_shape[1:], factor)
        return self.backend == "engine" and fits

    @property
    def default_size(self) -> tuple[int, int]:
        """(height, width) of a text-to-image sample when none is asked for: the U-Net's sample size x the VAE's
        scale factor."""
        size = self.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else size
        return h * self.vae_scale, w * self.vae_scale

    def latent_shape(self, height: int | None = None, width: int | None = None) -> tuple[int, int, int]:
        """The U-Net's sample shape (C, h, w) for a ``height`` x ``width`` image (default: ``default_size``)."""
        check_size(height, width)
        default_h, default_w = self.default_size
        height, width, scale = height or default_h, width or default_w, self.vae_scale
        if height % scale or width % scale:
            raise FastdiffError(f"height and width must be multiples of the VAE's {scale}, got {height}x{width}")
        return (self.unet.config.in_channels, height // scale, width // scale)

    def sampler_for(
        self, name: str, steps: int, start: int = 0, eta: float = 0.0,
        guidance_interval: tuple[float, float] = FULL_GUIDANCE,
    ) -> Sampler:  # fmt: skip
        """Sampler ``name`` over ``steps`` steps, beginning at step ``start``, guided at the steps of
        ``guidance_interval`` (built once, then cached)."""
        key = (name, steps, start, eta, guidance_interval)
        if key not in self._samplers:
            self._samplers[key] = make_sampler(
                name, self.schedule, steps, eta=eta, device=self.device, karras=self.karras, start=start,
                guidance_interval=guidance_interval,
            )  # fmt: skip
        return self._samplers[key]

    def clear_prepared(self) -> None:
        """Drop the samplers built so far and, on the engine, its prepared loops, CUDA graphs and fused forwards
        (``Engine.clear``): memory back, and the next call of each kind rebuilds (from the kernel plan: no tuning)."""
        self._samplers.clear()
        if self.backend == "engine" and self._engine is not None:
            self.engine.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def split_guidance(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Run guided calls as one of two processes of ``group`` (``fastdiff.pipelines.guidance_parallel``): this
        rank computes one guidance half of each U-Net call and both ranks return the same images. On the engine the
        gather runs inside its sampling loop (``fastdiff.engine.GuidanceHalf``); ``torch.distributed`` must be
        initialised with two processes."""
        if self.patch_split is not None:
            raise FastdiffError("guidance-parallel and patch-parallel do not combine: use one")
        self.guidance_split = GuidanceSplit(group)
        if self.backend == "engine":
            self.engine.split_guidance(group)

    def split_patches(self, group: torch.distributed.ProcessGroup | None = None, warmup: int = DEFAULT_WARMUP) -> None:
        """Run every call as one of the processes of ``group`` (``fastdiff.pipelines.patch_parallel``): this rank
        runs the U-Net on its band of the latent's rows, the others' activations from the previous step after
        ``warmup`` synchronous steps; all ranks return the same images. Eager backend only; ``torch.distributed``
        must be initialised with two or more processes."""
        if self.backend != "eager":
            raise FastdiffError(
                "patch-parallel runs on the eager backend (backend='eager'): the engine's loop is not split yet"
            )
        if self.guidance_split is not None:
            raise FastdiffError("guidance-parallel and patch-parallel do not combine: use one")
        self.patch_split = PatchSplit(group, warmup)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        guidance_scale: float | Sequence[float] = DEFAULT_GUIDANCE,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = 1,
        seeds: int | Sequence[int] | None = None,
        latents: torch.Tensor | None = None,
        steps: int | None = None,
        sampler: str | None = None,
        image: InitImage | None = None,
        strength: float = 0.8,
        eta: float = 0.0,
        output_type: str = "pil",
        progress: bool = True,
        cache_interval: int = 1,
        guidance_interval: tuple[float, float] = FULL_GUIDANCE,
    ) -> list[Image.Image] | np.ndarray | torch.Tensor:
        """Sample ``num_images_per_prompt`` images for each prompt (image order: prompt-major, as diffusers).

        negative_prompt: one for all prompts or one per prompt (default ""); used when ``guidance_scale`` > 1
        (classifier-free guidance; 0 to 1 runs the conditional model alone, as diffusers does; negative values are
        refused, where diffusers would quietly run without guidance). guidance_scale: one for all prompts or one per
        prompt; per-prompt scales are all > 1 or all <= 1 (a guided and an unguided prompt cannot share a call).
        height/width: multiples of 8 (default ``default_size``). seeds: one int per image, or one int ``s`` meaning
        ``s, s+1, ...`` (default ``0..N-1``).
        latents: unit-variance noise [N, C, h/f, w/f] (f: ``vae_scale``, 8 for SD) replacing the seeded draw: x_T
        for text-to-image (scaled by the sampler's initial noise scale, as diffusers does) or the noise added to the
        image for img2img. steps, sampler: override the pipeline's for this call; eta: DDIM's noise scale.

        image: img2img from a PIL image (or list, or [0, 1] array/tensor; one for all prompts or one per prompt)
        whose size fixes the output size. It is VAE-encoded and its posterior *sampled* (diffusers' default
        ``retrieve_latents(..., sample_mode="sample")``) with noise draw ``ENCODE_COUNTER`` of each image's seed;
        ``int(steps * strength)`` of the ``steps`` steps run, from the image noised to that step's level.

        output_type: "pil" (list of PIL images), "np" (float32 [N, H, W, 3] in [0, 1]), "pt" ([N, 3, H, W] in
        [0, 1]) or "tensor" ([N, 3, H, W] in [-1, 1]); tensors stay on the pipeline's device.

        cache_interval: step caching (``fastdiff.models.step_cache``, DeepCache): a full U-Net forward every N-th
        step of the run, the shallow path on its deep feature in between (1: off).

        guidance_interval: (start, stop) fractions of the steps run; guidance applies at steps ``int(start·N) <= i
        < int(stop·N)`` and the others take the conditional output alone (diffusers' ``ClassifierFreeGuidance``
        guider's ``start``/``stop``; see ``make_sampler``). Default (0, 1): every step, as ``StableDiffusionPipeline``.

        Prompt problems (words out of the model's vocabulary, prompts longer than its tokens) are logged, one
        warning line each, and kept in ``last_prompt_warnings`` until the next call.
        """
        self.last_prompt_warnings = []
        guidance_interval = check_guidance_interval(guidance_interval)
        step_cache.check(self.unet, cache_interval)
        if self.guidance_split is not None and cache_interval > 1:
            raise FastdiffError("guidance-parallel runs every step in full: use cache_interval=1")
        if self.patch_split is not None and cache_interval > 1:
            raise FastdiffError("patch-parallel runs every step in full: use cache_interval=1")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise FastdiffError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
        if negative_prompt is None or isinstance(negative_prompt, str):
            negatives = [negative_prompt or ""] * len(prompts)
        elif isinstance(negative_prompt, list) and all(isinstance(p, str) for p in negative_prompt):
            negatives = negative_prompt
            if len(negatives) != len(prompts):
                raise FastdiffError(f"got {len(negatives)} negative prompts for {len(prompts)} prompts")
        else:
            raise FastdiffError(f"negative_prompt must be a string or a list of strings, got {negative_prompt!r}")
        scales = guidance_scales(guidance_scale, len(prompts))
        per_prompt = num_images_per_prompt
        if isinstance(per_prompt, bool) or not isinstance(per_prompt, numbers.Integral) or per_prompt <= 0:
            raise FastdiffError(f"num_images_per_prompt must be a positive int, got {per_prompt!r}")
        check_output_type(output_type, OUTPUT_TYPES)
        count = len(prompts) * per_prompt
        seed_list = expand_seeds(seeds, count, f" ({len(prompts)} prompts x {per_prompt} per prompt)")
        check_size(height, width)
        pixels = None
        if image is not None:
            check_strength(strength)
            pixels = image_batch(image)
            if pixels.shape[0] not in (1, len(prompts)):
                raise FastdiffError(f"got {pixels.shape[0]} init images for {len(prompts)} prompts: give 1 or one each")
            image_h, image_w = pixels.shape[-2:]
            if (height or image_h, width or image_w) != (image_h, image_w):
                raise FastdiffError(f"height x width {height}x{width} differ from the init image's {image_h}x{image_w}")
            height, width = image_h, image_w
        shape = self.latent_shape(height, width)
        if self.patch_split is not None:
            self.patch_split.check_height(self.unet, shape[1])
        if latents is not None and tuple(latents.shape) != (count, *shape):
            raise FastdiffError(f"latents have shape {tuple(latents.shape)}, expected {(count, *shape)}")
        steps = self.steps if steps is None else steps
        name = self.sampler_name if sampler is None else sampler
        run = self.sampler_for(name, steps, eta=eta, guidance_interval=guidance_interval)  # checks them
        if pixels is not None:
            run = self.sampler_for(name, steps, start_step(steps, strength), eta, guidance_interval)

        seed_ids = seed_tensor(seed_list, self.device)
        noise = initial_noise(seed_ids, shape, self.device) if latents is None else latents.to(self.device)
        noise = noise.to(torch.float32)
        guided = scales[0] > 1
        context = self._text_states(prompts, negatives if guided else None, per_prompt)
        if pixels is None:
            x = noise * run.init_scale
        else:
            x = run.noised_state(self._encode(pixels, len(prompts), per_prompt, seed_ids), noise)
        guidance = None
        if guided:
            scale_rows = torch.tensor(scales, dtype=torch.float32).repeat_interleave(per_prompt)
            guidance = host_to_device(scale_rows, self.device)  # no wait for the GPU's queue
        if self.uses_engine(shape):
            engine = self.engine
            engine.prepare(
                self.unet, run, count, self.dtype, size=shape[1:], guided=guided, context_tokens=context.shape[1],
                cache_interval=cache_interval,
            )  # fmt: skip
            x0 = engine.run(x, seed_ids, context=context, guidance=guidance, scale=False)
            decoded = engine.decode(self.vae, x0, self.dtype)
        else:
            home = self.unet.conv_in.weight.device  # the engine backend keeps the U-Net in host memory
            try:
                unet = self.unet.to(self.device)
                split = self.patch_split or (self.guidance_split if guided else None)
                x0 = denoise(unet, run, x, context, guidance, seed_ids, self.dtype, progress, cache_interval, split)
            finally:
                self.unet.to(home)
            decoded = self.vae.decode((x0 / self.vae.config.scaling_factor).to(self.dtype)).float()
        if output_type == "tensor":
            return decoded.clamp(-1, 1)
        images = (decoded / 2 + 0.5).clamp(0, 1)
        if output_type == "pt":  # (tensors stay on the device, unsynchronised: the caller checks them if it wants)
            return images
        warn_if_nonfinite(decoded, self.backend, self.dtype)  # read on the host now anyway
        if output_type == "np":
            return images.cpu().permute(0, 2, 3, 1).numpy()
        return to_pil(decoded)

    def _text_states(self, prompts: list[str], negatives: list[str] | None, per_prompt: int) -> torch.Tensor:
        """Text states [N or 2N, tokens, width]: (uncond; cond) with guidance.

        Each text is encoded alone (batch 1) and kept in an LRU cache of ``TEXT_CACHE_SIZE`` texts, so a text's
        states are the same bytes whatever other prompts share the call (a kernel's float result may depend on the
        batch size) and a served prompt asked for again is not encoded again."""
        texts = prompts if negatives is None else negatives + prompts
        distinct = list(dict.fromkeys(texts))
        parts = self.components
        self.last_prompt_warnings = log_prompt_warnings(parts.tokenizer, distinct)
        found = {}
        for text in distinct:
            found[text] = self._text_cache.pop(text, None)
            if found[text] is None:
                encoder, tokenizer = parts.text_encoder, parts.tokenizer
                found[text] = encode_prompts(encoder, tokenizer, [text], self.device, check=False)
        self._text_cache.update(found)  # this call's texts are the most recent
        while len(self._text_cache) > TEXT_CACHE_SIZE:
            self._text_cache.popitem(last=False)
        states = torch.cat([found[t] for t in texts])
        return states.repeat_interleave(per_prompt, dim=0)

    def _encode(self, pixels: torch.Tensor, prompts: int, per_prompt: int, seeds: torch.Tensor) -> torch.Tensor:
        """Scaled VAE latents [N, 4, h, w] of the init image(s): posterior mean + std · seeded noise. A grayscale VAE
        (one input channel, as fashion-mnist-t2i's) gets the mean of the RGB channels (exact for gray images)."""
        if self.vae.config.in_channels == 1:
            pixels = pixels.mean(dim=1, keepdim=True)
        posterior = self.vae.encode(pixels.to(self.device, self.dtype))
        mean, std = posterior.mean.float(), posterior.std.float()
        repeats = per_prompt * (prompts if pixels.shape[0] == 1 else 1)
        mean, std = mean.repeat_interleave(repeats, dim=0), std.repeat_interleave(repeats, dim=0)
        sample = mean + std * posterior_noise(seeds, tuple(mean.shape[1:]))
        return sample * self.vae.config.scaling_factor


def posterior_noise(seeds: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The unit noise that samples each image's VAE posterior in img2img: draw ``ENCODE_COUNTER`` of its seed."""
    return draw(seeds, ENCODE_COUNTER, shape)


@torch.no_grad()
def denoise(
    unet: torch.nn.Module,
    sampler: Sampler,
    x: torch.Tensor,
    context: torch.Tensor,
    guidance: torch.Tensor | None,
    seeds: torch.Tensor,
    model_dtype: torch.dtype,
    progress: bool = False,
    cache_interval: int = 1,
    split: GuidanceSplit | PatchSplit | None = None,
) -> torch.Tensor:
    """Run ``sampler`` from state ``x`` (fp32 [B, ...]) conditioned on text states ``context``; returns the clean
    latents. With ``guidance`` [B] the U-Net sees [x; x] against ``context`` = [uncond; cond] (2B rows) and the
    sampler step combines the halves; step noise is drawn from ``seeds``. ``cache_interval`` N > 1: step caching
    (``fastdiff.models.step_cache.cached_forward``). ``split``: this process computes one half of each guided
    U-Net call and gathers the other (``fastdiff.pipelines.guidance_parallel``), or one band of the latent's rows
    (``fastdiff.pipelines.patch_parallel``)."""
    context = context.to(model_dtype)
    if isinstance(split, PatchSplit):
        with split.run(unet) as wrap:
            model = wrap(lambda inp, t: unet(inp, t, context))
            return run_sampler(model, sampler, x, seeds, model_dtype, guidance, progress=progress)
    if split is not None:
        model = split.wrap(lambda inp, t, rows: unet(inp, t, context[rows]))
    elif step_cache.check(unet, cache_interval) > 1:
        model = lambda inp, t, deep: step_cache.cached_forward(unet, inp, t, deep, context)  # noqa: E731
    else:
        model = lambda inp, t: unet(inp, t, context)  # noqa: E731
    return run_sampler(
        model, sampler, x, seeds, model_dtype, guidance, progress=progress, cache_interval=cache_interval
    )
