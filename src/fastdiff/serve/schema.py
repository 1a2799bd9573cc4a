"""The request schema of ``POST /v1/images`` and its checks against the served model (all before any sampling)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SEED = 2**53 - 1
"""Largest seed: every seed survives a round trip through JavaScript numbers (the browser page)."""

MAX_STEPS = 1000
MAX_PROMPT_CHARS = 2000
MAX_SEEDS = 4096


class RequestError(ValueError):
    """A request that is well-formed JSON but asks for something the served model cannot do (answered with 422)."""


class ImageRequest(BaseModel):
    """Body of ``POST /v1/images``. Every field is optional; the server fills in its defaults."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="text models only")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="text models only")
    n: int | None = Field(None, ge=1, description="number of images (default: len(seeds), else 1)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed of the first image; image k uses seed+k")
    seeds: list[int] | None = Field(None, min_length=1, max_length=MAX_SEEDS, description="one seed per image")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="denoising steps")
    sampler: str | None = Field(None, description="sampler name, see GET /v1/model")
    guidance: float | None = Field(None, ge=0, le=50, allow_inf_nan=False, description="text models only")
    size: int | tuple[int, int] | None = Field(None, description="S or [H, W]; must match the model")

    @model_validator(mode="after")
    def _seed_fields_agree(self) -> ImageRequest:
        if self.seed is not None and self.seeds is not None:
            raise ValueError("give either seed or seeds, not both")
        if self.seeds is not None:
            if self.n is not None and self.n != len(self.seeds):
                raise ValueError(f"n={self.n} but {len(self.seeds)} seeds were given")
            bad = [s for s in self.seeds if not 0 <= s <= MAX_SEED]
            if bad:
                raise ValueError(f"seed {bad[0]} is outside 0..{MAX_SEED}")
        return self


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/model`` reports and what requests are checked against."""

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

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ResolvedRequest:
    """A checked request with every default filled in: what the batcher runs and what the response echoes."""

    seeds: list[int]
    steps: int
    sampler: str
    prompt: str | None
    negative_prompt: str | None
    guidance: float | None
    size: tuple[int, int]

    def parameters(self) -> dict:
        record = asdict(self)
        record["n"] = len(self.seeds)
        record["size"] = list(self.size)
        return record

    def image_parameters(self, model: str) -> list[dict]:
        """What each image's PNG records: the model, its own seed and the settings that made it (not the request's
        other seeds, so a seed's PNG is the same bytes alone or in a batch)."""
        shared = {k: v for k, v in self.parameters().items() if k not in ("seeds", "n") and v is not None}
        return [{"model": model, **shared, "seed": seed} for seed in self.seeds]


def validation_message(exc: ValidationError) -> str:
    """One line naming each bad field: ``steps: Input should be greater than or equal to 1; ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        location = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)


def parse_request(body: bytes) -> ImageRequest:
    """Parse and type-check a JSON body; ``RequestError`` with a one-line message when it is malformed."""
    try:
        return ImageRequest.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise RequestError(validation_message(exc)) from None


def resolve_request(request: ImageRequest, info: ModelInfo) -> ResolvedRequest:
    """Check ``request`` against the served model and fill in defaults (a random seed when none is given)."""
    if info.conditional:
        if not request.prompt:
            raise RequestError(f"model {info.name!r} is a text-to-image model: 'prompt' is required")
    else:
        for field in ("prompt", "negative_prompt"):
            if getattr(request, field):
                raise RequestError(f"model {info.name!r} is unconditional: it takes no {field!r}")
        if request.guidance is not None:
            raise RequestError(f"model {info.name!r} is unconditional: it takes no 'guidance'")
    sampler = request.sampler or info.default_sampler
    if sampler not in info.samplers:
        raise RequestError(f"unknown sampler {sampler!r}: use one of {', '.join(info.samplers)}")
    steps = request.steps or info.default_steps
    size = (info.height, info.width)
    if request.size is not None:
        asked = (request.size, request.size) if isinstance(request.size, int) else tuple(request.size)
        if asked != size:
            raise RequestError(
                f"size {asked[0]}x{asked[1]} is not available: model {info.name!r} makes {size[0]}x{size[1]} images"
            )
    n = len(request.seeds) if request.seeds is not None else request.n or 1
    if n > info.max_images_per_request:
        raise RequestError(f"n={n} is more than this server's limit of {info.max_images_per_request} per request")
    if request.seeds is not None:
        seeds = list(request.seeds)
    else:
        first = request.seed if request.seed is not None else random.randrange(2**31)
        if first + n - 1 > MAX_SEED:
            raise RequestError(f"seeds {first}..{first + n - 1} go past {MAX_SEED}")
        seeds = list(range(first, first + n))
    return ResolvedRequest(
        seeds=seeds,
        steps=steps,
        sampler=sampler,
        prompt=request.prompt or None,
        negative_prompt=request.negative_prompt or None,
        guidance=request.guidance,
        size=size,
    )
