"""A text-to-image model of Fashion-MNIST in Stable Diffusion's own directory format, trained in two stages.

Stage ``vae`` trains a diffusers-config ``AutoencoderKL`` (32x32x1 images in [-1, 1] <-> 8x8x4 latents: three
levels, so 4 pixels per latent) with an L1 + L2 reconstruction loss and a small KL term, sets ``scaling_factor``
to 1 / the latent std of the training set (as SD's 0.18215 was chosen) and writes ``OUT/vae/`` (diffusers
format, fp16) with ``summary.json`` (test-set PSNR), ``loss.jsonl``, ``loss.png`` and ``reconstructions.png``.

Stage ``unet`` loads that VAE, encodes the training set once, and trains a CLIP text encoder (transformers'
``CLIPTextModel``, on a local tokenizer whose vocabulary holds every prompt word whole) jointly with a
``UNet2DConditionModel`` on the latents: epsilon prediction on SD's scaled-linear schedule, 10% empty prompts for
classifier-free guidance, min-SNR loss weights and an EMA of both networks. It writes a complete
``StableDiffusionPipeline`` directory (fp16 safetensors) that ``fastdiff.TextToImagePipeline`` and diffusers
both load, then samples it: ``samples.png`` (one row per class) and, in ``summary.json``, the bundled
classifier's accuracy on the generated images and their FD-FMNIST.

Each stage stops at ``max_steps`` or when ``max_seconds`` (counted from the stage's start) run out; the learning
rate decays on a cosine over whichever budget ends first, so a time-bound run still anneals. Output folders are
written all or nothing (``fastdiff.atomic.write_folder_atomic``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdiff.atomic import check_output_location, write_folder_atomic, write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.devices import resolve_device, synchronize
from fastdiff.errors import FastdiffError
from fastdiff.images import make_grid, save_png_atomic, to_pil
from fastdiff.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig, autoencoder_kl_from_dir
from fastdiff.models.stable_diffusion import END_OF_WORD, clip_tokenizer_files
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
from fastdiff.models.weights import find_weights, read_json_object
from fastdiff.samplers import ScheduleConfig, alphas_cumprod
from fastdiff.train.trainer import REPORT_SECONDS, ema_update, param_groups, plot_loss_curve

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- prompts

CLASS_NOUNS: tuple[tuple[str, ...], ...] = (
    ("t-shirt", "tshirt", "tee", "tee shirt", "top", "t-shirt/top", "t-shirts", "tees", "tops"),
    ("trousers", "pants", "jeans", "slacks", "trouser", "pair of trousers", "pair of pants"),
    ("pullover", "sweater", "jumper", "sweatshirt", "pullovers", "sweaters"),
    ("dress", "gown", "summer dress", "dresses"),
    ("coat", "jacket", "overcoat", "winter coat", "coats", "jackets"),
    ("sandal", "sandals", "strappy sandal"),
    ("shirt", "blouse", "button-down shirt", "shirts", "blouses"),
    ("sneaker", "sneakers", "trainers", "running shoe", "running shoes"),
    ("bag", "handbag", "purse", "tote bag", "shoulder bag", "bags", "handbags"),
    ("ankle boot", "ankle boots", "boot", "boots"),
)
"""What a user may call each Fashion-MNIST class (index = label); the first is the canonical name."""

PLURAL_NOUNS = frozenset(
    {
        *("t-shirts", "tees", "tops", "trousers", "pants", "jeans", "slacks", "pullovers", "sweaters", "dresses"),
        *("coats", "jackets", "sandals", "shirts", "blouses", "sneakers", "trainers", "running shoes", "bags"),
        *("handbags", "ankle boots", "boots"),
    }
)
"""Nouns that take no article ("a photo of trousers")."""

PROMPT_TEMPLATES = (
    "{noun}",
    "{phrase}",
    "a photo of {phrase}",
    "a picture of {phrase}",
    "an image of {phrase}",
    "a product photo of {phrase}",
    "{phrase}, product photo",
    "{noun}, product photo",
    "a black and white photo of {phrase}",
    "a grayscale photo of {phrase}",
    "a small photo of {phrase}",
)
"""``{noun}``: the bare noun ("ankle boot"); ``{phrase}``: with its article ("an ankle boot", "trousers")."""

CANONICAL_TEMPLATE = "a photo of {phrase}"
EMPTY_PROMPT = ""
"""The unconditional prompt of classifier-free guidance (what a dropped prompt becomes)."""

IMAGE_SIZE = 32
"""Fashion-MNIST's 28x28 images padded to this side (the padding is -1, black)."""
SAVE_DTYPE = torch.float16
"""Every written weight file is fp16."""
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
SUMMARY_NAME = "summary.json"
LOSS_LOG_NAME = "loss.jsonl"
LOSS_CURVE_NAME = "loss.png"

CLIP_WORD = re.compile(r"[a-z]+|[0-9]|[^\sa-z0-9]+")
"""CLIP's pre-tokenizer pattern (letters, single digits, runs of other symbols) on lowercase ASCII."""


def noun_phrase(noun: str) -> str:
    """``noun`` with its indefinite article ("a bag", "an ankle boot"); plurals stay bare ("trousers")."""
    if noun in PLURAL_NOUNS:
        return noun
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def class_prompts(label: int) -> tuple[str, ...]:
    """Every training prompt of class ``label`` (0..9): each template filled with each of its nouns, no repeats."""
    if not 0 <= label < len(CLASS_NOUNS):
        raise FastdiffError(f"Fashion-MNIST class {label!r} out of range 0..{len(CLASS_NOUNS) - 1}")
    prompts = [t.format(noun=n, phrase=noun_phrase(n)) for n in CLASS_NOUNS[label] for t in PROMPT_TEMPLATES]
    return tuple(dict.fromkeys(prompts))


def canonical_prompts() -> list[str]:
    """One prompt per class, in label order ("a photo of a t-shirt", ..., "a photo of an ankle boot")."""
    return [CANONICAL_TEMPLATE.format(phrase=noun_phrase(nouns[0])) for nouns in CLASS_NOUNS]


def random_prompt(label: int, rng: random.Random) -> str:
    """A prompt for class ``label`` drawn uniformly from ``class_prompts(label)``."""
    return rng.choice(class_prompts(label))


def prompt_table() -> tuple[list[str], list[int]]:
    """(prompts, labels): every class's prompts in label order, then the empty prompt (label -1)."""
    prompts, labels = [], []
    for label in range(len(CLASS_NOUNS)):
        for prompt in class_prompts(label):
            prompts.append(prompt)
            labels.append(label)
    return prompts + [EMPTY_PROMPT], labels + [-1]


# ---------------------------------------------------------------- tokenizer

TEXT_TOKENS = 77
"""CLIP's sequence length (SD's ``model_max_length``)."""


def prompt_words() -> list[str]:
    """The distinct CLIP words (pre-tokenized pieces) of every training prompt, sorted."""
    prompts, _ = prompt_table()
    return sorted({word for prompt in prompts for word in CLIP_WORD.findall(prompt.lower())})


def learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges that make each word of ``words`` (ASCII) one token: BPE training (most frequent pair
    first, ties broken by the pair's text) until no word has two symbols left."""
    pieces = [[*w[:-1], w[-1] + END_OF_WORD] for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for symbols in pieces:
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for k, symbols in enumerate(pieces):
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            pieces[k] = merged


def tokenizer_files() -> dict[str, str]:
    """File name -> text of the CLIP tokenizer (``clip_tokenizer_files``): the byte-level alphabet (so any text
    tokenizes), every prompt word whole, SD 1.x's special tokens and padding (<|endoftext|>), 77 tokens."""
    return clip_tokenizer_files(learn_merges(prompt_words()), max_length=TEXT_TOKENS)


def write_tokenizer(folder: Path) -> None:
    """Write ``tokenizer_files()`` into ``folder`` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")


def build_tokenizer() -> Any:
    """transformers' CLIPTokenizer on ``tokenizer_files()`` (no network)."""
    from fastdiff.models.stable_diffusion import import_transformers

    transformers = import_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))
        return transformers.CLIPTokenizer.from_pretrained(tmp, local_files_only=True)


def tokenize(tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    """Token ids [len(prompts), model_max_length] as SD's ``encode_prompt`` makes them (padded, truncated)."""
    max_length = tokenizer.model_max_length
    return tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")[
        "input_ids"
    ]


# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class TextToImagePreset:
    """The three networks: VAE, U-Net (on the VAE's latents) and CLIP text encoder (its width = the U-Net's
    ``cross_attention_dim``)."""

    vae: AutoencoderKLConfig
    unet: UNet2DConditionConfig
    text_layers: int
    text_heads: int

    @property
    def text_width(self) -> int:
        return self.unet.cross_attention_dim


def _preset(
    vae_channels: tuple[int, ...],
    vae_groups: int,
    unet_channels: tuple[int, ...],
    unet_layers: int,
    unet_groups: int,
    heads: tuple[int, ...],
    text_width: int,
    text_layers: int,
    text_heads: int,
) -> TextToImagePreset:
    levels = len(vae_channels)
    vae = AutoencoderKLConfig(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=vae_channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=vae_groups,
        sample_size=IMAGE_SIZE,
    )
    unet_levels = len(unet_channels)
    unet = UNet2DConditionConfig(
        sample_size=IMAGE_SIZE // 2 ** (levels - 1),
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * (unet_levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (unet_levels - 1),
        block_out_channels=unet_channels,
        layers_per_block=unet_layers,
        norm_num_groups=unet_groups,
        cross_attention_dim=text_width,
        attention_head_dim=heads,
    )
    return TextToImagePreset(vae=vae, unet=unet, text_layers=text_layers, text_heads=text_heads)


PRESETS: dict[str, TextToImagePreset] = {
    # VAE 3.8 M, U-Net 8.8 M, text encoder 0.9 M parameters: about 27 MB of fp16 safetensors.
    "fashion-mnist": _preset((64, 128, 128), 32, (64, 128, 128), 2, 32, (2, 4, 4), 128, 4, 4),
    # For tests and dry runs: every block type of the real one at a few thousand parameters each.
    "tiny": _preset((8, 8, 16), 4, (8, 16, 16), 1, 4, (1, 2, 2), 16, 1, 2),
}


def resolve_preset(name: str) -> TextToImagePreset:
    if name not in PRESETS:
        raise FastdiffError(f"unknown text-to-image preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_text_encoder(preset: TextToImagePreset, tokenizer: Any) -> nn.Module:
    """A randomly initialised transformers ``CLIPTextModel`` for ``preset`` and ``tokenizer``'s vocabulary."""
    from fastdiff.models.stable_diffusion import import_transformers

    transformers = import_transformers()
    width = preset.text_width
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=width,
        intermediate_size=4 * width,
        projection_dim=width,
        num_hidden_layers=preset.text_layers,
        num_attention_heads=preset.text_heads,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.CLIPTextModel(config)


SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "DDIMScheduler",
    "_diffusers_version": "0.42.1",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "prediction_type": "epsilon",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "timestep_spacing": "trailing",
    "thresholding": False,
    "rescale_betas_zero_snr": False,
}
"""SD's training schedule (scaled-linear betas 0.00085..0.012, 1000 steps, epsilon, steps_offset 1 as diffusers'
StableDiffusionPipeline insists); "trailing" spacing so that few-step samplers start at the last training step."""

DIFFUSERS_VERSION = SCHEDULER_CONFIG["_diffusers_version"]
"""The diffusers release whose directory format the written configs follow."""

MODEL_INDEX: dict[str, Any] = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", SCHEDULER_CONFIG["_class_name"]],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


# ---------------------------------------------------------------- configs


@dataclass
class StageConfig:
    """Settings both stages share. ``max_seconds`` counts from the stage's start (data loading included)."""

    out_dir: Path = field(default_factory=lambda: Path("runs/text-to-image"))
    preset: str = "fashion-mnist"
    data_dir: Path | None = None
    max_steps: int = 20000
    max_seconds: float | None = None
    batch_size: int = 256
    lr: float = 5e-4
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    limit_images: int | None = None
    log_every: int = 50
    seed: int = 0
    device: str = "auto"
    bf16: bool = True
    channels_last: bool = True
    compile: bool = False
    progress: bool = True


@dataclass
class VAEStageConfig(StageConfig):
    """Stage 1: the VAE. ``kl_weight`` scales the KL term per pixel (SD's 1e-6 relative to a per-pixel sum);
    ``eval_images``: test images for the PSNR (default all 10000)."""

    kl_weight: float = 1e-6
    eval_images: int | None = None
    scaling_images: int = 10000
    """Training images whose latents set ``scaling_factor``."""


@dataclass
class UNetStageConfig(StageConfig):
    """Stage 2: text encoder + U-Net on the latents of the stage-1 VAE in ``vae_dir``."""

    vae_dir: Path | None = None
    max_steps: int = 40000
    batch_size: int = 512
    warmup_steps: int = 500
    weight_decay: float = 0.01
    ema_decay: float = 0.9995
    prompt_dropout: float = 0.1
    min_snr_gamma: float = 5.0
    """Loss weight min(SNR, gamma) / SNR (Hang et al. 2023); 0 turns it off."""
    grid_per_prompt: int = 8
    eval_per_class: int = 100
    """Images per class sampled after training for the classifier's accuracy and FD-FMNIST (0: none)."""
    eval_steps: int = 20
    eval_sampler: str = "dpmsolver++"
    eval_guidance: tuple[float, ...] = (3.0, 7.5)


def validate_stage(config: StageConfig) -> None:
    """A one-line FastdiffError naming the first bad setting."""
    resolve_preset(config.preset)
    for name in ("max_steps", "batch_size", "log_every"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FastdiffError(f"{name} must be a positive integer, got {value!r}")
    for name in ("warmup_steps", "weight_decay", "grad_clip"):
        if getattr(config, name) < 0:
            raise FastdiffError(f"{name} must be >= 0, got {getattr(config, name)}")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise FastdiffError(f"lr must be positive, got {config.lr}")
    if not 0 <= config.min_lr_ratio <= 1:
        raise FastdiffError(f"min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}")
    if config.max_seconds is not None and not config.max_seconds > 0:
        raise FastdiffError(f"max_seconds must be positive, got {config.max_seconds}")
    if config.limit_images is not None and config.limit_images <= 0:
        raise FastdiffError(f"limit_images must be positive, got {config.limit_images}")
    if isinstance(config, VAEStageConfig):
        if config.kl_weight < 0:
            raise FastdiffError(f"kl_weight must be >= 0, got {config.kl_weight}")
        if config.eval_images is not None and config.eval_images <= 0:
            raise FastdiffError(f"eval_images must be positive, got {config.eval_images}")
        if config.scaling_images <= 0:
            raise FastdiffError(f"scaling_images must be positive, got {config.scaling_images}")
    if isinstance(config, UNetStageConfig):
        if not 0 <= config.ema_decay < 1:
            raise FastdiffError(f"ema_decay must be in [0, 1), got {config.ema_decay}")
        if not 0 <= config.prompt_dropout < 1:
            raise FastdiffError(f"prompt_dropout must be in [0, 1), got {config.prompt_dropout}")
        if config.min_snr_gamma < 0:
            raise FastdiffError(f"min_snr_gamma must be >= 0, got {config.min_snr_gamma}")
        for name in ("grid_per_prompt", "eval_per_class"):
            if getattr(config, name) < 0:
                raise FastdiffError(f"{name} must be >= 0, got {getattr(config, name)}")
        if config.eval_steps <= 0:
            raise FastdiffError(f"eval_steps must be positive, got {config.eval_steps}")


def find_vae_dir(path: Path) -> Path:
    """The VAE folder of a stage-1 output (``path/vae``) or ``path`` itself; a FastdiffError if neither holds a
    diffusers AutoencoderKL (config.json + weights)."""
    path = Path(path)
    if not path.exists():
        raise FastdiffError(f"--vae {path} not found: run the vae stage first (fastdiff train text-to-image)")
    for folder in (path / "vae", path):
        if (folder / "config.json").is_file():
            find_weights(folder)  # a one-line error if they are missing
            return folder
    raise FastdiffError(f"--vae {path} holds no VAE: expected {path / 'vae' / 'config.json'} (the vae stage's output)")


def check_stage(config: StageConfig) -> None:
    """Everything that can be checked before any work: the settings, the output folder, the stage-2 VAE
    folder and its architecture, and transformers for stage 2."""
    validate_stage(config)
    check_output_location(config.out_dir, "--out", folder=True)
    if isinstance(config, UNetStageConfig):
        if config.vae_dir is None:
            raise FastdiffError("the unet stage needs --vae DIR (the output of the vae stage)")
        vae_folder = find_vae_dir(config.vae_dir)
        if Path(config.out_dir).resolve() in (Path(config.vae_dir).resolve(), vae_folder.resolve()):
            raise FastdiffError(f"--out must be another folder than --vae ({config.vae_dir})")
        vae_config = AutoencoderKLConfig.from_dict(
            read_json_object(vae_folder / "config.json"), str(vae_folder / "config.json")
        )
        check_vae_fits(vae_config, resolve_preset(config.preset), vae_folder)
        from fastdiff.models.stable_diffusion import import_transformers

        import_transformers()
        from fastdiff.samplers import SAMPLERS

        if config.eval_sampler not in SAMPLERS:
            raise FastdiffError(f"unknown eval sampler {config.eval_sampler!r}: use one of {', '.join(SAMPLERS)}")


def check_vae_fits(vae: AutoencoderKLConfig, preset: TextToImagePreset, source: Path) -> None:
    """The stage-1 VAE must have the preset's architecture (its scaling_factor aside)."""
    if dataclasses.replace(vae, scaling_factor=preset.vae.scaling_factor) != preset.vae:
        raise FastdiffError(
            f"{source}: the VAE is not the one of this preset (block_out_channels {list(vae.block_out_channels)}, "
            f"{vae.in_channels} channel(s)): use the same --preset as the vae stage"
        )


# ---------------------------------------------------------------- shared training machinery


class Budget:
    """Where a stage stands against ``max_steps`` and ``max_seconds`` (from ``start``), and its learning rate:
    linear warm-up over ``warmup_steps``, then a cosine from ``lr`` to ``lr * min_lr_ratio`` over the fraction
    of the budget used, by steps or by time, whichever is further along."""

    def __init__(self, config: StageConfig, start: float) -> None:
        self.config = config
        self.deadline = None if config.max_seconds is None else start + config.max_seconds
        self.loop_start = time.perf_counter()

    def progress(self, step: int) -> float:
        done = step / self.config.max_steps
        if self.deadline is not None:
            span = max(self.deadline - self.loop_start, 1e-9)
            done = max(done, (time.perf_counter() - self.loop_start) / span)
        return min(done, 1.0)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def lr(self, step: int) -> float:
        cfg = self.config
        warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        cosine = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def setup_device(config: StageConfig) -> tuple[torch.device, bool, torch.memory_format]:
    """(device, bf16 autocast on, activation memory format); TF32 and cuDNN autotuning on CUDA."""
    device = resolve_device(config.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    memory_format = torch.channels_last if config.channels_last and on_cuda else torch.contiguous_format
    return device, config.bf16 and on_cuda, memory_format


def maybe_compile(fn: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
    """``torch.compile(fn)`` if asked (compilation itself happens at the first call), else ``fn``; the module
    itself stays uncompiled, so its state dict keeps its names."""
    if not enabled:
        return fn
    try:
        return torch.compile(fn)
    except Exception as exc:  # no compiler backend on this machine: train eagerly
        log.warning("torch.compile unavailable (%s: %s): training eagerly", type(exc).__name__, exc)
        return fn


def run_first_step(step: Callable[[torch.Tensor], Any], batch: torch.Tensor, fallback: Callable[[], None]) -> Any:
    """``step(batch)``, the first training step; if it fails inside torch.compile, ``fallback()`` (switch to
    eager) and again."""
    try:
        return step(batch)
    except (FastdiffError, KeyboardInterrupt, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:  # Dynamo / Inductor errors surface at the first compiled call
        log.warning("torch.compile failed at the first step (%s: %s): training eagerly", type(exc).__name__, exc)
        fallback()
        return step(batch)


def epoch_batches(num: int, batch: int, generator: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Index batches of ``batch`` over ``num`` items, a new permutation each epoch (the remainder dropped)."""
    while True:
        order = torch.randperm(num, generator=generator).to(device)
        for b in range(num // batch):
            yield order[b * batch : (b + 1) * batch]


class LossLog:
    """Loss records every ``log_every`` steps (means over the steps since the last record, one sync each), a
    tqdm bar and a progress line in the log every ``REPORT_SECONDS``."""

    def __init__(self, config: StageConfig, desc: str) -> None:
        self.config = config
        self.records: list[dict] = []
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.start = self.interval_start = self.last_report = time.perf_counter()
        self.bar = tqdm(total=config.max_steps, unit="step", desc=desc, disable=not config.progress)

    def add(self, step: int, values: dict[str, torch.Tensor], lr: float, last: bool) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums[key] + value.detach() if key in self.sums else value.detach().clone()
        self.steps += 1
        self.bar.update(1)
        if step % self.config.log_every and not last:
            return
        now = time.perf_counter()
        record = {"step": step, **{k: v.item() / self.steps for k, v in self.sums.items()}, "loss_steps": self.steps}
        record["lr"] = lr
        record["images_per_s"] = round(self.steps * self.config.batch_size / (now - self.interval_start), 1)
        record["elapsed_s"] = round(now - self.start, 3)
        self.records.append(record)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
        if now - self.last_report >= REPORT_SECONDS or last:
            log.info("step %d: loss %.4f, %.0f img/s", step, record["loss"], record["images_per_s"])
            self.last_report = now
        self.sums, self.steps, self.interval_start = {}, 0, now

    def close(self) -> None:
        self.bar.close()

    def final_loss(self) -> float | None:
        """Step-weighted mean loss of the last 10 records."""
        recent = self.records[-10:]
        steps = sum(r["loss_steps"] for r in recent)
        return round(sum(r["loss"] * r["loss_steps"] for r in recent) / steps, 6) if steps else None

    def jsonl(self) -> str:
        return "".join(json.dumps(r) + "\n" for r in self.records)


def run_budgeted_loop(
    config: Any, budget: Budget, loss_log: LossLog, optimizer: torch.optim.Optimizer,
    next_batch: Callable[[], torch.Tensor], train_step: Callable[[torch.Tensor], dict], eager: Callable[[], None],
    after_step: Callable[[int], None] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """The training loop of both stages: the budget's learning rate, one ``train_step`` per batch (the first one
    through ``run_first_step``, which falls back to ``eager`` if a compiled step fails), ``after_step(step)``
    (EMA), the loss log; stops at ``config.max_steps`` or when the time budget runs out. Returns (steps, why)."""
    step, stopped = 0, "max_steps"
    try:
        while step < config.max_steps:
            lr = budget.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = next_batch()
            values = run_first_step(train_step, batch, eager) if step == 0 else train_step(batch)
            if after_step is not None:
                after_step(step)
            step += 1
            out_of_time = budget.out_of_time() or budget.progress(step) >= 1.0
            loss_log.add(step, values, lr, last=step == config.max_steps or out_of_time)
            if out_of_time and step < config.max_steps:
                stopped = "max_seconds"
                break
    finally:
        loss_log.close()
    return step, stopped


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def diffusers_config(config: Any, class_name: str) -> dict[str, Any]:
    """A config dataclass as a diffusers ``config.json`` dict (tuples as lists)."""
    data = json.loads(json.dumps(dataclasses.asdict(config)))
    return {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **data}


def safetensors_bytes(module: nn.Module, dtype: torch.dtype) -> bytes:
    """The module's state dict (floating tensors cast to ``dtype``) serialised as safetensors, in memory (a plain
    file write then gives it the umask's mode; safetensors' save_file makes owner-only files)."""
    from safetensors.torch import save

    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in module.state_dict().items()
    }
    return save(state, metadata={"format": "pt"})


def write_diffusers_model(folder: Path, module: nn.Module, class_name: str, dtype: torch.dtype) -> None:
    """config.json + diffusion_pytorch_model.safetensors of fastdiff's diffusers-compatible ``module``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = diffusers_config(module.config, class_name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / DIFFUSERS_WEIGHTS).write_bytes(safetensors_bytes(module, dtype))


def round_to(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with every floating parameter and buffer rounded to ``dtype`` and back (in place): the
    weights the saved files hold, in the module's own precision."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))
    return module


def load_split(config: StageConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from fastdiff.data import load_fashion_mnist

    return load_fashion_mnist(split, data_dir=config.data_dir, pad_to=IMAGE_SIZE)


def check_images(images: torch.Tensor, name: str) -> None:
    expected = (1, IMAGE_SIZE, IMAGE_SIZE)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise FastdiffError(f"{name} have shape {tuple(images.shape)}, expected [N, *{expected}]")


# ---------------------------------------------------------------- stage 1: the VAE


def vae_loss(
    encode: Callable[[torch.Tensor], Any],
    decode: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    kl_weight: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """L1 + L2 reconstruction (per pixel) of decode(a posterior sample) + ``kl_weight`` x KL(posterior || N(0, I))
    summed over each image's latents and divided by its pixels (SD's weighting against a per-pixel sum)."""
    posterior = encode(x)
    mean, logvar = posterior.mean, posterior.logvar
    noise = torch.randn(mean.shape, generator=generator, device=x.device, dtype=mean.dtype)
    recon = decode(mean + posterior.std * noise).float()
    l1 = (recon - x).abs().mean()
    l2 = (recon - x).pow(2).mean()
    mean, logvar = mean.float(), logvar.float()
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).flatten(1).sum(1).mean() / x[0].numel()
    return {"loss": l1 + l2 + kl_weight * kl, "l1": l1, "l2": l2, "kl": kl}


@torch.no_grad()
def encode_batches(
    vae: AutoencoderKL, images: torch.Tensor, device: torch.device, batch: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior (mean, std) of ``images``, each fp32 [N, latent_channels, h, w] on ``device``."""
    means, stds = [], []
    for i in range(0, images.shape[0], batch):
        posterior = vae.encode(images[i : i + batch].to(device, torch.float32))
        means.append(posterior.mean.float())
        stds.append(posterior.std.float())
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def reconstruction_psnr(vae: AutoencoderKL, images: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Mean PSNR (dB, data range 2 for [-1, 1]) of decode(posterior mean) on the whole 32x32 image and on the
    28x28 Fashion-MNIST area inside the padding."""
    from fastdiff.quality.psnr import psnr

    full, inner, pad = [], [], (IMAGE_SIZE - 28) // 2
    for i in range(0, images.shape[0], 1000):
        x = images[i : i + 1000].to(device, torch.float32)
        recon = vae.decode(vae.encode(x).mean).float().clamp(-1, 1)
        full.append(psnr(recon, x).cpu())
        crop = (slice(None), slice(None), slice(pad, pad + 28), slice(pad, pad + 28))
        inner.append(psnr(recon[crop], x[crop]).cpu())
    return {"psnr_db": round(float(torch.cat(full).mean()), 3), "psnr_db_28": round(float(torch.cat(inner).mean()), 3)}


def train_vae(
    config: VAEStageConfig,
    train_images: torch.Tensor | None = None,
    test_images: torch.Tensor | None = None,
) -> dict:
    """Stage 1: train the VAE, set its ``scaling_factor``, measure test PSNR and write ``config.out_dir``
    (``vae/``, summary.json, loss.jsonl, loss.png, reconstructions.png) all or nothing; returns the summary.

    ``train_images`` / ``test_images`` ([N, 1, 32, 32] in [-1, 1]) replace the Fashion-MNIST splits.
    """
    start = time.perf_counter()
    check_stage(config)
    preset = resolve_preset(config.preset)
    device, use_bf16, memory_format = setup_device(config)
    if train_images is None:
        train_images, _ = load_split(config, "train")
    if test_images is None:
        test_images, _ = load_split(config, "test")
    check_images(train_images, "training images")
    check_images(test_images, "test images")
    if config.limit_images is not None:
        train_images = train_images[: config.limit_images]
    if config.eval_images is not None:
        test_images = test_images[: config.eval_images]
    if train_images.shape[0] < config.batch_size:
        raise FastdiffError(f"batch size {config.batch_size} is larger than the {train_images.shape[0]} images")
    images = train_images.to(device, torch.float32).contiguous(memory_format=memory_format)

    torch.manual_seed(config.seed)
    vae = AutoencoderKL(preset.vae).to(device, memory_format=memory_format).train()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups(vae, config.weight_decay), lr=config.lr, **fused)
    data_rng = torch.Generator().manual_seed(config.seed)
    noise_rng = torch.Generator(device=device).manual_seed(config.seed + 1)
    log.info(
        "vae stage: %.2f M params on %d images, batch %d, on %s%s",
        num_params(vae) / 1e6,
        images.shape[0],
        config.batch_size,
        device,
        " (bf16 autocast)" if use_bf16 else "",
    )
    fns = {"encode": maybe_compile(vae.encode, config.compile), "decode": maybe_compile(vae.decode, config.compile)}

    def losses(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            return vae_loss(fns["encode"], fns["decode"], x, config.kl_weight, noise_rng)

    def train_step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        values = losses(x)
        values["loss"].backward()
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        values["grad_norm"] = torch.nn.utils.clip_grad_norm_(vae.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return values

    def eager() -> None:
        optimizer.zero_grad(set_to_none=True)
        fns.update(encode=vae.encode, decode=vae.decode)

    budget = Budget(config, start)
    batches = epoch_batches(images.shape[0], config.batch_size, data_rng, device)
    loss_log = LossLog(config, "vae")
    step, stopped = run_budgeted_loop(
        config, budget, loss_log, optimizer, lambda: images[next(batches)], train_step, eager
    )
    synchronize(device)
    train_seconds = time.perf_counter() - budget.loop_start

    vae = round_to(vae.eval(), SAVE_DTYPE)
    scaling = torch.Generator(device=device).manual_seed(config.seed + 2)
    mean, std = encode_batches(vae, images[: config.scaling_images], device)
    latents = mean + std * torch.randn(mean.shape, generator=scaling, device=device)
    latent_std, latent_mean = float(latents.std()), float(latents.mean())
    vae.config = dataclasses.replace(vae.config, scaling_factor=round(1.0 / latent_std, 5))
    quality = reconstruction_psnr(vae, test_images, device)
    shown = test_images[:16].to(device)
    with torch.no_grad():
        recon = vae.decode(vae.encode(shown).mean).float().clamp(-1, 1)
    summary = {
        "stage": "vae",
        "preset": config.preset,
        "step": step,
        "stopped": stopped,
        "train_seconds": round(train_seconds, 3),
        "images_per_s": round(step * config.batch_size / train_seconds, 1) if step else None,
        "final_loss": loss_log.final_loss(),
        **quality,
        "test_images": int(test_images.shape[0]),
        "scaling_factor": vae.config.scaling_factor,
        "latent_mean": round(latent_mean, 5),
        "latent_std": round(latent_std, 5),
        "latent_shape": list(mean.shape[1:]),
        "params": num_params(vae),
        "settings": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "env": environment(),
    }

    def fill(tmp: Path) -> None:
        write_diffusers_model(tmp / "vae", vae, "AutoencoderKL", SAVE_DTYPE)
        summary["vae_bytes"] = folder_bytes(tmp / "vae")
        summary["seconds"] = round(time.perf_counter() - start, 3)
        (tmp / LOSS_LOG_NAME).write_text(loss_log.jsonl())
        plot_loss_curve(loss_log.records, tmp / LOSS_CURVE_NAME)
        save_png_atomic(make_grid(to_pil(torch.cat([shown, recon]).cpu()), nrow=16), tmp / "reconstructions.png")
        (tmp / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")

    write_folder_atomic(config.out_dir, fill)
    log.info(
        "vae stage: %d steps (%s) in %.0f s, test PSNR %.2f dB (%.2f dB on the 28x28 area), scaling_factor %.5f; "
        "wrote %s",
        step,
        stopped,
        train_seconds,
        quality["psnr_db"],
        quality["psnr_db_28"],
        vae.config.scaling_factor,
        config.out_dir,
    )
    return summary


# ---------------------------------------------------------------- stage 2: text encoder + U-Net

GRID_GUIDANCE = 7.5
"""Guidance of samples.png: ``fastdiff sample``'s default."""
EVAL_SEED = 10**6
"""Seed of the first evaluation image (the grid uses seeds from 0)."""
FD_MIN_IMAGES = 500
"""FD-FMNIST is reported from this many generated images on (fewer give a biased, noisy distance)."""


def copy_files(src: Path, dst: Path) -> None:
    """Copy the files of ``src`` into ``dst`` by plain writes (so they get the umask's mode)."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())


def write_pipeline(
    folder: Path, unet: UNet2DConditionModel, vae: AutoencoderKL, text_encoder: nn.Module, dtype: torch.dtype
) -> dict[str, int]:
    """A diffusers ``StableDiffusionPipeline`` directory in ``folder``: model_index.json, scheduler/, tokenizer/,
    text_encoder/ (transformers' own save), unet/ and vae/ (diffusers configs), weights in ``dtype``; returns the
    bytes of each component."""
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2) + "\n")
    write_tokenizer(folder / "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        copy.deepcopy(text_encoder).to("cpu", dtype).save_pretrained(tmp)
        copy_files(Path(tmp), folder / "text_encoder")
    write_diffusers_model(folder / "unet", unet, "UNet2DConditionModel", dtype)
    write_diffusers_model(folder / "vae", vae, "AutoencoderKL", dtype)
    return {part: folder_bytes(folder / part) for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")}


@torch.no_grad()
def evaluate_pipeline(folder: Path, config: UNetStageConfig, device: torch.device) -> dict:
    """Sample the written pipeline (fp32 on the eager backend, the reference path; ``eval_sampler``,
    ``eval_steps``): samples.png (``grid_per_prompt`` images of each canonical prompt, one row per class, seeds
    from 0) and, for each ``eval_guidance``, the bundled classifier's accuracy on ``eval_per_class`` images per
    class (and FD-FMNIST against the test split)."""
    from fastdiff.pipelines.text_to_image import TextToImagePipeline
    from fastdiff.quality.classifier import classifier_accuracy, fd_fmnist, load_classifier

    pipe = TextToImagePipeline.from_pretrained(
        folder, device=device, dtype="fp32", sampler=config.eval_sampler, steps=config.eval_steps, backend="eager"
    )
    prompts = canonical_prompts()
    result: dict[str, Any] = {"sampler": config.eval_sampler, "steps": config.eval_steps, "prompts": prompts}
    if config.grid_per_prompt:
        n = config.grid_per_prompt
        images = pipe(prompts, num_images_per_prompt=n, seeds=0, guidance_scale=GRID_GUIDANCE, progress=False)
        params = {"prompts": prompts, "guidance": GRID_GUIDANCE, "sampler": config.eval_sampler}
        save_png_atomic(make_grid(images, nrow=n), folder / "samples.png", {**params, "steps": config.eval_steps})
        result["grid"] = {"file": "samples.png", "per_prompt": n, "guidance": GRID_GUIDANCE}
    if config.eval_per_class:
        n = config.eval_per_class
        classifier = load_classifier(device=device)
        labels = torch.arange(len(prompts)).repeat_interleave(n)
        result["per_class"] = n
        result["guidance"] = {}
        for guidance in config.eval_guidance:
            images = torch.cat(
                [
                    pipe(p, num_images_per_prompt=n, seeds=EVAL_SEED + k * n, guidance_scale=guidance,
                         output_type="tensor", progress=False).float().cpu()
                    for k, p in enumerate(prompts)
                ]
            )  # fmt: skip
            record: dict[str, Any] = {"accuracy": round(classifier_accuracy(classifier, images, labels), 4)}
            if images.shape[0] >= FD_MIN_IMAGES:
                record["fd_fmnist"] = round(fd_fmnist(images, "test", data_dir=config.data_dir, device=device), 3)
            result["guidance"][str(guidance)] = record
            log.info("guidance %s: classifier accuracy %.3f %s", guidance, record["accuracy"], record)
    return result


def train_text_to_image(
    config: UNetStageConfig, images: torch.Tensor | None = None, labels: torch.Tensor | None = None
) -> dict:
    """Stage 2: train the text encoder and the U-Net on the latents of the stage-1 VAE, write the
    StableDiffusionPipeline directory ``config.out_dir`` (fp16, all or nothing, with loss.jsonl, loss.png and
    summary.json), then sample it (samples.png, accuracy and FD-FMNIST in summary.json); returns the summary.

    ``images`` ([N, 1, 32, 32] in [-1, 1]) and ``labels`` ([N], 0..9) replace the Fashion-MNIST train split.
    """
    start = time.perf_counter()
    check_stage(config)
    preset = resolve_preset(config.preset)
    device, use_bf16, memory_format = setup_device(config)
    vae_folder = find_vae_dir(config.vae_dir)
    vae = autoencoder_kl_from_dir(vae_folder, read_json_object(vae_folder / "config.json"))
    vae = vae.to(device, torch.float32).eval().requires_grad_(False)
    if images is None or labels is None:
        images, labels = load_split(config, "train")
    check_images(images, "training images")
    bad_values = labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < len(CLASS_NOUNS)
    if labels.shape != (images.shape[0],) or labels.is_floating_point() or bad_values:
        raise FastdiffError(f"labels must be [{images.shape[0]}] class indices 0..9, got shape {tuple(labels.shape)}")
    if config.limit_images is not None:
        images, labels = images[: config.limit_images], labels[: config.limit_images]
    if images.shape[0] < config.batch_size:
        raise FastdiffError(f"batch size {config.batch_size} is larger than the {images.shape[0]} images")
    latent_mean, latent_std = encode_batches(vae, images, device)
    scale = vae.config.scaling_factor
    labels = labels.to(device, torch.int64)

    tokenizer = build_tokenizer()
    prompts, prompt_labels = prompt_table()
    ids = tokenize(tokenizer, prompts).to(device)
    per_class = torch.bincount(torch.tensor(prompt_labels[:-1]), minlength=len(CLASS_NOUNS))
    counts = per_class.to(device)
    offsets = (torch.cumsum(per_class, 0) - per_class).to(device)
    empty = len(prompts) - 1

    torch.manual_seed(config.seed)
    text_encoder = make_text_encoder(preset, tokenizer).to(device).train()
    unet = UNet2DConditionModel(preset.unet)
    with torch.no_grad():  # start from a zero prediction: a random U-Net's output is only noise to unlearn
        unet.conv_out.weight.zero_()
        unet.conv_out.bias.zero_()
    unet = unet.to(device, memory_format=memory_format).train()
    ema_unet = copy.deepcopy(unet).eval().requires_grad_(False)
    ema_text = copy.deepcopy(text_encoder).eval().requires_grad_(False)
    networks = nn.ModuleList([unet, text_encoder])
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups(networks, config.weight_decay), lr=config.lr, **fused)

    schedule = ScheduleConfig.from_diffusers(SCHEDULER_CONFIG)
    abar = alphas_cumprod(schedule).to(device, torch.float32)
    sqrt_abar, sqrt_one_minus = abar.sqrt(), (1 - abar).sqrt()
    snr = abar / (1 - abar)
    weights = snr.clamp(max=config.min_snr_gamma) / snr if config.min_snr_gamma > 0 else torch.ones_like(snr)
    timesteps = schedule.num_train_timesteps
    data_rng = torch.Generator().manual_seed(config.seed)
    noise_rng = torch.Generator(device=device).manual_seed(config.seed + 1)
    params = {"unet": num_params(unet), "text_encoder": num_params(text_encoder), "vae": num_params(vae)}
    log.info(
        "unet stage: U-Net %.2f M + text encoder %.2f M params on %d latents %s, %d prompts, batch %d, on %s%s",
        params["unet"] / 1e6,
        params["text_encoder"] / 1e6,
        images.shape[0],
        tuple(latent_mean.shape[1:]),
        len(prompts),
        config.batch_size,
        device,
        " (bf16 autocast)" if use_bf16 else "",
    )
    fns = {"unet": maybe_compile(unet, config.compile)}

    def train_step(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = idx.shape[0]
        noise_shape = (batch, *latent_mean.shape[1:])
        sample = torch.randn(noise_shape, generator=noise_rng, device=device)
        z0 = (latent_mean[idx] + latent_std[idx] * sample) * scale
        y = labels[idx]
        pick = torch.rand(batch, generator=noise_rng, device=device)
        choice = offsets[y] + (pick * counts[y]).long().minimum(counts[y] - 1)
        dropped = torch.rand(batch, generator=noise_rng, device=device) < config.prompt_dropout
        choice = torch.where(dropped, torch.full_like(choice, empty), choice)
        t = torch.randint(0, timesteps, (batch,), generator=noise_rng, device=device)
        noise = torch.randn(noise_shape, generator=noise_rng, device=device)
        x_t = sqrt_abar[t].view(-1, 1, 1, 1) * z0 + sqrt_one_minus[t].view(-1, 1, 1, 1) * noise
        x_t = x_t.contiguous(memory_format=memory_format)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            states = text_encoder(ids[choice])[0]
            out = fns["unet"](x_t, t, states)
        mse = (out.float() - noise).pow(2).mean(dim=(1, 2, 3))
        loss = (weights[t] * mse).mean()
        loss.backward()
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(networks.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "mse": mse.mean().detach(), "grad_norm": grad_norm}

    def eager() -> None:
        optimizer.zero_grad(set_to_none=True)
        fns["unet"] = unet

    budget = Budget(config, start)
    batches = epoch_batches(images.shape[0], config.batch_size, data_rng, device)

    def after_step(step: int) -> None:
        ema_update(ema_unet, unet, config.ema_decay, step)
        ema_update(ema_text, text_encoder, config.ema_decay, step)

    loss_log = LossLog(config, "unet")
    step, stopped = run_budgeted_loop(
        config, budget, loss_log, optimizer, lambda: next(batches), train_step, eager, after_step
    )
    synchronize(device)
    train_seconds = time.perf_counter() - budget.loop_start

    summary: dict[str, Any] = {
        "stage": "unet",
        "preset": config.preset,
        "step": step,
        "stopped": stopped,
        "train_seconds": round(train_seconds, 3),
        "images_per_s": round(step * config.batch_size / train_seconds, 1) if step else None,
        "final_loss": loss_log.final_loss(),
        "params": params,
        "vae": str(vae_folder),
        "scaling_factor": scale,
        "num_images": int(images.shape[0]),
        "num_prompts": len(prompts) - 1,
        "vocab_size": len(tokenizer.get_vocab()),
        "settings": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "env": environment(),
    }

    def fill(tmp: Path) -> None:
        summary["bytes"] = write_pipeline(tmp, ema_unet, vae, ema_text, SAVE_DTYPE)
        summary["model_bytes"] = sum(summary["bytes"].values()) + (tmp / "model_index.json").stat().st_size
        (tmp / LOSS_LOG_NAME).write_text(loss_log.jsonl())
        plot_loss_curve(loss_log.records, tmp / LOSS_CURVE_NAME)
        summary["seconds"] = round(time.perf_counter() - start, 3)
        (tmp / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")

    out_dir = write_folder_atomic(config.out_dir, fill)
    log.info(
        "unet stage: %d steps (%s) in %.0f s, final loss %s; wrote %s (%.1f MB of models)",
        step,
        stopped,
        train_seconds,
        summary["final_loss"],
        out_dir,
        summary["model_bytes"] / 1e6,
    )
    try:
        summary["eval"] = evaluate_pipeline(out_dir, config, device)
    except Exception as exc:  # the model is written and must outlive any failure to sample it: record why
        log.exception("sampling the written pipeline failed")
        summary["eval"] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["seconds"] = round(time.perf_counter() - start, 3)
    write_text_atomic(out_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
    return summary
