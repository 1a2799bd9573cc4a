"""The request schema of ``POST /v1/images`` and its checks against the served model (all before any sampling).

Text-to-image models take ``prompt`` (every image) or ``prompts`` (one image each), ``negative_prompt``,
``guidance``, a size (``size``, or ``width``/``height``) and for img2img ``init_image`` (a base64 PNG or JPEG) with
``strength``; unconditional models take none of these but ``size``. Both take ``n``, ``seed``/``seeds``, ``steps``
and ``sampler``.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fastdiff.cli_args import FULL_GUIDANCE, check_guidance_interval
from fastdiff.errors import FastdiffError

MAX_SEED = 2**53 - 1
"""Largest seed: every seed survives a round trip through JavaScript numbers (the browser page)."""

MAX_STEPS = 1000
MAX_PROMPT_CHARS = 2000
MAX_SEEDS = 4096
MAX_GUIDANCE = 50.0
DEFAULT_STRENGTH = 0.8
"""img2img strength of requests that name none (diffusers' default)."""

PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
PromptWarnings = Callable[[list[str]], list[str]]
"""``warnings(texts)``: one line per problem of the texts (``fastdiff.models.stable_diffusion.prompt_warnings``)."""


class RequestError(ValueError):
    """A request that is well-formed JSON but asks for something the served model cannot do (answered with 422)."""


class ImageRequest(BaseModel):
    """Body of ``POST /v1/images``: at least one field; the server fills in the rest from its defaults."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="text models: the prompt of every image")
    prompts: list[PromptText] | None = Field(
        None, min_length=1, max_length=MAX_SEEDS, description="text models: one prompt per image (n = len(prompts))"
    )
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="text models only")
    n: int | None = Field(None, ge=1, description="number of images (default: len(seeds) or len(prompts), else 1)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed of the first image; image k uses seed+k")
    seeds: list[int] | None = Field(None, min_length=1, max_length=MAX_SEEDS, description="one seed per image")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="denoising steps")
    sampler: str | None = Field(None, description="sampler name, see GET /v1/model")
    guidance: float | None = Field(
        None, ge=0, le=MAX_GUIDANCE, allow_inf_nan=False, description="text models: <= 1 turns guidance off"
    )
    guidance_interval: tuple[float, float] | None = Field(
        None, description="text models: [start, stop], the fractions of the steps guided (default [0, 1]: all)"
    )
    size: int | tuple[int, int] | None = Field(None, description="S or [H, W]; see GET /v1/model for the sizes")
    width: int | None = Field(None, ge=1, description="text models: image width (or use size)")
    height: int | None = Field(None, ge=1, description="text models: image height (or use size)")
    init_image: str | None = Field(None, min_length=1, description="text models, img2img: a base64 PNG or JPEG")
    strength: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description=f"img2img: how much to change (default {DEFAULT_STRENGTH})"
    )

    @model_validator(mode="after")
    def _fields_agree(self) -> ImageRequest:
        if self.seed is not None and self.seeds is not None:
            raise ValueError("give either seed or seeds, not both")
        if self.prompt is not None and self.prompts is not None:
            raise ValueError("give either prompt (every image) or prompts (one image each), not both")
        if self.size is not None and (self.width is not None or self.height is not None):
            raise ValueError("give either size or width/height, not both")
        if self.seeds is not None:
            if self.n is not None and self.n != len(self.seeds):
                raise ValueError(f"n={self.n} but {len(self.seeds)} seeds were given")
            bad = [s for s in self.seeds if not 0 <= s <= MAX_SEED]
            if bad:
                raise ValueError(f"seed {bad[0]} is outside 0..{MAX_SEED}")
        if self.prompts is not None:
            if self.n is not None and self.n != len(self.prompts):
                raise ValueError(f"n={self.n} but {len(self.prompts)} prompts were given (one image each)")
            if self.seeds is not None and len(self.seeds) != len(self.prompts):
                raise ValueError(f"{len(self.seeds)} seeds for {len(self.prompts)} prompts: give one seed per prompt")
        if self.strength is not None and self.init_image is None:
            raise ValueError("strength is for img2img: it needs init_image")
        return self


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/model`` reports and what requests are checked against.

    ``height`` x ``width``: the default size. Sizes allowed: heights and widths that are multiples of
    ``size_multiple`` up to ``max_side``; ``size_multiple`` None: only the default size.
    """

    name: str
    conditional: bool
    channels: int
    height: int
    width: int
    samplers: tuple[str, ...]
    default_sampler: str
    default_steps: int
    max_images_per_request: int
    max_steps: int
    device: str
    default_guidance: float | None = None
    size_multiple: int | None = None
    max_side: int | None = None
    img2img: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    def sizes_text(self) -> str:
        if self.size_multiple is None:
            return f"{self.height}x{self.width} images"
        return f"heights and widths that are multiples of {self.size_multiple} up to {self.max_side}"


@dataclass(frozen=True)
class ResolvedRequest:
    """A checked request with every default filled in: what the batcher runs and what the response echoes.

    ``prompts``: one prompt per image (instead of ``prompt``); ``init_image`` (img2img) is already decoded and
    of ``size``; ``warnings``: one line per prompt problem (unknown words, prompts over the model's tokens).
    """

    seeds: list[int]
    steps: int
    sampler: str
    prompt: str | None
    negative_prompt: str | None
    guidance: float | None
    size: tuple[int, int]
    prompts: list[str] | None = None
    guidance_interval: tuple[float, float] | None = None
    """Guided steps other than all of them (None: every step, or no guidance)."""
    strength: float | None = None
    init_image: Image.Image | None = field(default=None, repr=False, compare=False)
    warnings: list[str] = field(default_factory=list)

    def image_prompts(self) -> list[str] | None:
        """The prompt of each image (None for unconditional models)."""
        if self.prompts is not None:
            return list(self.prompts)
        return None if self.prompt is None else [self.prompt] * len(self.seeds)

    def parameters(self) -> dict:
        """The settings echoed in a JSON response (``init_image`` and ``warnings`` left out)."""
        return {
            "seeds": list(self.seeds),
            "n": len(self.seeds),
            "steps": self.steps,
            "sampler": self.sampler,
            "prompt": self.prompt,
            "prompts": None if self.prompts is None else list(self.prompts),
            "negative_prompt": self.negative_prompt,
            "guidance": self.guidance,
            "guidance_interval": None if self.guidance_interval is None else list(self.guidance_interval),
            "size": list(self.size),
            "strength": self.strength,
        }

    def image_parameters(self, model: str) -> list[dict]:
        """What each image's PNG records: the model, its own prompt and seed and the settings that made it (not the
        request's other seeds or prompts, so a seed's PNG is the same bytes alone or in a batch)."""
        per_request = ("seeds", "n", "prompt", "prompts")
        shared = {k: v for k, v in self.parameters().items() if k not in per_request and v is not None}
        prompts = self.image_prompts() or [None] * len(self.seeds)
        return [
            {"model": model, **({"prompt": prompt} if prompt is not None else {}), **shared, "seed": seed}
            for prompt, seed in zip(prompts, self.seeds, strict=True)
        ]


def validation_message(exc: ValidationError) -> str:
    """One line naming each bad field: ``steps: Input should be greater than or equal to 1; ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        location = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)


def parse_request(body: bytes) -> ImageRequest:
    """Parse and type-check a JSON body (no body reads as ``{}``); ``RequestError`` with a one-line message when
    it is malformed."""
    try:
        return ImageRequest.model_validate_json(body.strip() or b"{}")
    except ValidationError as exc:
        raise RequestError(validation_message(exc)) from None


def example_request(info: ModelInfo) -> str:
    return '{"prompt": "a red dress", "n": 2}' if info.conditional else '{"n": 2}'


def resolve_request(
    request: ImageRequest, info: ModelInfo, prompt_warnings: PromptWarnings | None = None
) -> ResolvedRequest:
    """Check ``request`` against the served model and fill in defaults (a random seed when none is given).

    ``prompt_warnings`` (text models): the warnings of the request's prompts, computed here so that each request
    gets its own whatever batch it runs in.
    """
    if not request.model_fields_set:
        raise RequestError(f"the request is empty: send a JSON object such as {example_request(info)}")
    text_fields = (
        "prompt", "prompts", "negative_prompt", "guidance", "guidance_interval", "init_image", "strength", "width",
        "height",
    )  # fmt: skip
    if info.conditional:
        if not request.prompt and not request.prompts:
            raise RequestError(f"model {info.name!r} is a text-to-image model: 'prompt' (or 'prompts') is required")
        if request.init_image is not None and not info.img2img:
            raise RequestError(f"model {info.name!r} takes no 'init_image' (this server does not offer img2img)")
    else:
        for name in text_fields:
            if getattr(request, name) is not None:
                raise RequestError(f"model {info.name!r} is unconditional: it takes no {name!r}")
    sampler = request.sampler or info.default_sampler
    if sampler not in info.samplers:
        raise RequestError(f"unknown sampler {sampler!r}: use one of {', '.join(info.samplers)}")
    steps = request.steps or info.default_steps
    if request.seeds is not None:
        n = len(request.seeds)
    elif request.prompts is not None:
        n = len(request.prompts)
    else:
        n = request.n or 1
    if n > info.max_images_per_request:
        raise RequestError(f"n={n} is more than this server's limit of {info.max_images_per_request} per request")
    init_image = None if request.init_image is None else decode_image(request.init_image, info)
    size = resolve_size(request, info, init_image)
    strength = None
    if init_image is not None:
        strength = DEFAULT_STRENGTH if request.strength is None else request.strength
        if int(steps * strength) == 0:
            raise RequestError(f"strength {strength} leaves none of the {steps} steps to run: raise strength or steps")
    if request.seeds is not None:
        seeds = list(request.seeds)
    else:
        first = request.seed if request.seed is not None else random.randrange(2**31)
        if first + n - 1 > MAX_SEED:
            raise RequestError(f"seeds {first}..{first + n - 1} go past {MAX_SEED}")
        seeds = list(range(first, first + n))
    guidance = None
    guidance_interval = None
    warnings: list[str] = []
    if info.conditional:
        guidance = info.default_guidance if request.guidance is None else request.guidance
        if guidance is None:
            raise RequestError(f"model {info.name!r} has no default guidance: give 'guidance'")
        texts = list(dict.fromkeys(request.prompts or [request.prompt]))
        if request.negative_prompt:
            texts.append(request.negative_prompt)
        warnings = prompt_warnings(texts) if prompt_warnings is not None else []
        if request.negative_prompt and guidance <= 1:
            warnings.append(f"negative_prompt is unused: guidance {guidance:g} <= 1 runs the model without it")
        if request.guidance_interval is not None:
            try:
                interval = check_guidance_interval(request.guidance_interval, "guidance_interval")
            except FastdiffError as exc:
                raise RequestError(str(exc)) from None
            if guidance <= 1:
                warnings.append(f"guidance_interval is unused: guidance {guidance:g} <= 1 guides no step")
            elif interval != FULL_GUIDANCE:
                guidance_interval = interval
    return ResolvedRequest(
        seeds=seeds,
        steps=steps,
        sampler=sampler,
        prompt=request.prompt or None,
        negative_prompt=request.negative_prompt or None,
        guidance=guidance,
        size=size,
        prompts=None if request.prompts is None else list(request.prompts),
        guidance_interval=guidance_interval,
        strength=strength,
        init_image=init_image,
        warnings=warnings,
    )


def resolve_size(request: ImageRequest, info: ModelInfo, init_image: Image.Image | None) -> tuple[int, int]:
    """(height, width): ``size``, else ``height``/``width`` (the other side from the init image or the default),
    else the init image's size, else the model's; it must be one the model makes, and the init image's."""
    default_h, default_w = (init_image.height, init_image.width) if init_image is not None else (0, 0)
    default_h, default_w = default_h or info.height, default_w or info.width
    if request.size is not None:
        asked = (request.size, request.size) if isinstance(request.size, int) else tuple(request.size)
    else:
        asked = (request.height or default_h, request.width or default_w)
    if info.size_multiple is None:
        allowed = asked == (info.height, info.width)
    else:
        allowed = all(0 < side <= (info.max_side or side) and side % info.size_multiple == 0 for side in asked)
    if not allowed:
        raise RequestError(
            f"size {asked[0]}x{asked[1]} is not available: model {info.name!r} makes {info.sizes_text()}"
        )
    if init_image is not None and (init_image.height, init_image.width) != asked:
        raise RequestError(
            f"init_image is {init_image.height}x{init_image.width} (height x width) but the request asks for "
            f"{asked[0]}x{asked[1]}: resize it or leave out the size"
        )
    return asked


def decode_image(text: str, info: ModelInfo) -> Image.Image:
    """A base64 PNG/JPEG (optionally a ``data:image/...;base64,`` URL) as an RGB image; its size is checked
    against ``info``'s largest side before the pixels are decoded."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("init_image: not valid base64") from None
    try:
        image = Image.open(io.BytesIO(data), formats=("PNG", "JPEG"))
    except (UnidentifiedImageError, OSError):
        raise RequestError("init_image: not a PNG or JPEG image") from None
    except Image.DecompressionBombError:
        raise RequestError("init_image: its declared size is far too large") from None
    largest = info.max_side or max(info.height, info.width)
    if max(image.size) > largest or math.prod(image.size) == 0:
        raise RequestError(f"init_image is {image.height}x{image.width}: model {info.name!r} makes {info.sizes_text()}")
    try:
        return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise RequestError(f"init_image: cannot decode it ({exc})".splitlines()[0]) from None
