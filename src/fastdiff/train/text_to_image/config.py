"""The recipe's networks and settings: the architecture presets (VAE, U-Net, CLIP text encoder), SD's training
schedule, the two stages' configs, and every check that can run before any work.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdiff.atomic import check_output_location
from fastdiff.errors import FastdiffError
from fastdiff.models.autoencoder_kl import AutoencoderKLConfig
from fastdiff.models.clip_text import CLIPTextConfig, CLIPTextModel
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig
from fastdiff.models.weights import find_weights, read_json_object, read_state_dict

IMAGE_SIZE = 32
"""Fashion-MNIST's 28x28 images padded to this side (the padding is -1, black)."""

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
    latent_channels: int = 4,
) -> TextToImagePreset:
    levels = len(vae_channels)
    vae = AutoencoderKLConfig(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=vae_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=vae_groups,
        sample_size=IMAGE_SIZE,
    )
    unet_levels = len(unet_channels)
    unet = UNet2DConditionConfig(
        sample_size=IMAGE_SIZE // 2 ** (levels - 1),
        in_channels=latent_channels,
        out_channels=latent_channels,
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
    # 32x32x1 <-> 16x16x4 latents (two VAE levels): VAE 2.6 M, U-Net 8.8 M, text encoder 0.9 M parameters, about 25 MB
    # of fp16 safetensors. Its reconstructions score FD-FMNIST 0.45 against 5.7 for the three-level 8x8x4 VAE of the
    # first bundled model (docs/fashion-mnist-t2i/README.md has the candidates' table).
    "fashion-mnist": _preset((64, 128), 32, (64, 128, 128), 2, 32, (2, 4, 4), 128, 4, 4),
    # For tests and dry runs: every block type of the real one at a few thousand parameters each.
    "tiny": _preset((8, 8, 16), 4, (8, 16, 16), 1, 4, (1, 2, 2), 16, 1, 2),
}


def resolve_preset(name: str) -> TextToImagePreset:
    if name not in PRESETS:
        raise FastdiffError(f"unknown text-to-image preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_text_encoder(preset: TextToImagePreset, tokenizer: Any) -> CLIPTextModel:
    """A randomly initialised CLIP text encoder (``fastdiff.models.clip_text``, transformers' initialisation) for
    ``preset`` and ``tokenizer``'s vocabulary."""
    width = preset.text_width
    config = CLIPTextConfig(
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
    return CLIPTextModel(config)


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
    pause_after_s: float | None = None
    """Stop this run so many seconds after it starts and write a checkpoint next to ``out_dir``; the same command
    resumes from it (None: run to the end)."""


@dataclass
class VAEStageConfig(StageConfig):
    """Stage 1: the VAE. ``kl_weight`` scales the KL term per pixel (SD's 1e-6 relative to a per-pixel sum);
    ``eval_images``: test images for the PSNR (default all 10000)."""

    kl_weight: float = 1e-6
    eval_images: int | None = None
    scaling_images: int = 10000
    """Training images whose latents set ``scaling_factor``."""
    fd_images: int = 10000
    """Training images whose reconstructions get an FD-FMNIST against the test set: the floor that no sampler on
    these latents can beat (0: none)."""


@dataclass
class UNetStageConfig(StageConfig):
    """Stage 2: text encoder + U-Net on the latents of the stage-1 VAE in ``vae_dir``."""

    vae_dir: Path | str | None = None
    max_steps: int = 40000
    batch_size: int = 512
    warmup_steps: int = 500
    weight_decay: float = 0.01
    ema_decay: float = 0.9995
    prompt_dropout: float = 0.1
    min_snr_gamma: float = 5.0
    """Loss weight min(SNR, gamma) / SNR (Hang et al. 2023); 0 turns it off."""
    init_from: Path | str | None = None
    """A text-to-image pipeline directory or a bundled pipeline's name (fashion-mnist-t2i) whose U-Net and text
    encoder the stage starts from instead of a fresh initialisation: a longer training of a model that exists. Its
    networks must have the preset's architecture and its VAE must be ``vae_dir``'s (the latents it learned)."""
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
    for name in ("max_seconds", "pause_after_s"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise FastdiffError(f"{name} must be positive, got {value}")
    if config.limit_images is not None and config.limit_images <= 0:
        raise FastdiffError(f"limit_images must be positive, got {config.limit_images}")
    if isinstance(config, VAEStageConfig):
        if config.kl_weight < 0:
            raise FastdiffError(f"kl_weight must be >= 0, got {config.kl_weight}")
        if config.eval_images is not None and config.eval_images <= 0:
            raise FastdiffError(f"eval_images must be positive, got {config.eval_images}")
        if config.scaling_images <= 0:
            raise FastdiffError(f"scaling_images must be positive, got {config.scaling_images}")
        if config.fd_images < 0:
            raise FastdiffError(f"fd_images must be >= 0, got {config.fd_images}")
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


def find_vae_dir(path: Path | str) -> Path:
    """The VAE folder of a stage-1 output or a pipeline (``path/vae``; ``path`` may name a bundled pipeline) or
    ``path`` itself; a FastdiffError if neither holds a diffusers AutoencoderKL (config.json + weights)."""
    from fastdiff.models.stable_diffusion import resolve_pipeline_dir

    path = resolve_pipeline_dir(path)
    if not path.exists():
        raise FastdiffError(f"--vae {path} not found: run the vae stage first (fastdiff train text-to-image)")
    for folder in (path / "vae", path):
        if (folder / "config.json").is_file():
            find_weights(folder)  # a one-line error if they are missing
            return folder
    raise FastdiffError(f"--vae {path} holds no VAE: expected {path / 'vae' / 'config.json'} (the vae stage's output)")


def check_stage(config: StageConfig) -> None:
    """Everything that can be checked before any work: the settings, the output folder, the stage-2 VAE
    folder and its architecture, and the tokenizers package for stage 2."""
    validate_stage(config)
    check_output_location(config.out_dir, "--out", folder=True)
    if isinstance(config, UNetStageConfig):
        if config.vae_dir is None:
            raise FastdiffError("the unet stage needs --vae DIR (the output of the vae stage)")
        from fastdiff.models.stable_diffusion import resolve_pipeline_dir

        vae_folder = find_vae_dir(config.vae_dir)
        given = resolve_pipeline_dir(config.vae_dir)  # the folder --vae names (a bundled pipeline's name too)
        if Path(config.out_dir).resolve() in (given.resolve(), vae_folder.resolve()):
            raise FastdiffError(f"--out must be another folder than --vae ({config.vae_dir})")
        vae_config = AutoencoderKLConfig.from_dict(
            read_json_object(vae_folder / "config.json"), str(vae_folder / "config.json")
        )
        check_vae_fits(vae_config, resolve_preset(config.preset), vae_folder)
        if config.init_from is not None:  # a directory or a bundled pipeline's name
            check_init_from(resolve_pipeline_dir(config.init_from), resolve_preset(config.preset), vae_folder)
        from fastdiff.models.clip_tokenizer import import_tokenizers

        import_tokenizers()
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


def check_init_from(folder: Path, preset: TextToImagePreset, vae_folder: Path) -> None:
    """``--init-from``: a pipeline directory with the preset's U-Net and text encoder sizes, this recipe's tokenizer
    (its embeddings are those words') and the VAE in ``vae_folder`` (the same config, scaling factor included, and
    the same weights at fp16)."""
    from fastdiff.train.text_to_image.prompts import tokenizer_files

    for part in ("unet", "text_encoder", "vae"):
        if not (folder / part / "config.json").is_file():
            raise FastdiffError(f"--init-from {folder} is no text-to-image pipeline directory: {part}/config.json "
                                "is missing")  # fmt: skip
    unet = UNet2DConditionConfig.from_dict(read_json_object(folder / "unet" / "config.json"), str(folder / "unet"))
    if unet != preset.unet:
        raise FastdiffError(f"--init-from {folder}: its U-Net is not the preset's architecture (use its --preset)")
    text = read_json_object(folder / "text_encoder" / "config.json")
    sizes = {"hidden_size": preset.text_width, "num_hidden_layers": preset.text_layers,
             "num_attention_heads": preset.text_heads}  # fmt: skip
    if any(text.get(key) != value for key, value in sizes.items()):
        raise FastdiffError(f"--init-from {folder}: its text encoder is not the preset's size (use its --preset)")
    for name, text in tokenizer_files().items():
        path = folder / "tokenizer" / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            raise FastdiffError(f"--init-from {folder}: its tokenizer is not this recipe's (tokenizer/{name} differs), "
                                "so its text encoder's embeddings are other words'")  # fmt: skip
    if not same_vae(folder / "vae", vae_folder):
        raise FastdiffError(f"--init-from {folder} was trained on another VAE than --vae {vae_folder}: its latents "
                            "would not be these")  # fmt: skip


def same_vae(a: Path, b: Path) -> bool:
    """Whether two VAE folders hold the same config (``_*`` keys aside) and the same weights at fp16 (a pipeline
    stores its VAE in fp16, the vae stage may not)."""

    def config(folder: Path) -> dict:
        return {k: v for k, v in read_json_object(folder / "config.json").items() if not k.startswith("_")}

    if config(a) != config(b):
        return False
    sa, sb = read_state_dict(find_weights(a)), read_state_dict(find_weights(b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].half(), sb[k].half()) for k in sa)
