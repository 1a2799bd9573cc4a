"""Tiny Stable Diffusion models and pipeline directories with the structure of the real SD 1.5 and SD 2.1.

The real shipped configs are written out below; the tiny ones shrink only widths, depths, the text width and the
sample size, keeping block types, projection kind, head counts (``attention_head_dim``), upcast_attention, etc.
diffusers and transformers build the random models (their default init, plus random norm affines so that a swapped
norm would show); ``write_tiny_sd_pipeline`` saves a full ``StableDiffusionPipeline`` directory with a tiny CLIP
text encoder and a byte-level CLIP tokenizer.

Import as ``from sd_fixtures import ...`` (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

SD_DOWN = ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
SD_UP = ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]

SD15_UNET_CONFIG = json.loads(
    """{
  "_class_name": "UNet2DConditionModel",
  "_diffusers_version": "0.6.0",
  "act_fn": "silu",
  "attention_head_dim": 8,
  "block_out_channels": [320, 640, 1280, 1280],
  "center_input_sample": false,
  "cross_attention_dim": 768,
  "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
  "downsample_padding": 1,
  "flip_sin_to_cos": true,
  "freq_shift": 0,
  "in_channels": 4,
  "layers_per_block": 2,
  "mid_block_scale_factor": 1,
  "norm_eps": 1e-05,
  "norm_num_groups": 32,
  "out_channels": 4,
  "sample_size": 64,
  "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]
}"""
)
"""runwayml/stable-diffusion-v1-5 unet/config.json."""

SD21_UNET_CONFIG = json.loads(
    """{
  "_class_name": "UNet2DConditionModel",
  "_diffusers_version": "0.10.0.dev0",
  "act_fn": "silu",
  "attention_head_dim": [5, 10, 20, 20],
  "block_out_channels": [320, 640, 1280, 1280],
  "center_input_sample": false,
  "cross_attention_dim": 1024,
  "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
  "downsample_padding": 1,
  "dual_cross_attention": false,
  "flip_sin_to_cos": true,
  "freq_shift": 0,
  "in_channels": 4,
  "layers_per_block": 2,
  "mid_block_scale_factor": 1,
  "norm_eps": 1e-05,
  "norm_num_groups": 32,
  "num_class_embeds": null,
  "only_cross_attention": false,
  "out_channels": 4,
  "sample_size": 96,
  "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
  "upcast_attention": true,
  "use_linear_projection": true
}"""
)
"""stabilityai/stable-diffusion-2-1 unet/config.json."""

SD_VAE_CONFIG = json.loads(
    """{
  "_class_name": "AutoencoderKL",
  "_diffusers_version": "0.6.0",
  "act_fn": "silu",
  "block_out_channels": [128, 256, 512, 512],
  "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
  "in_channels": 3,
  "latent_channels": 4,
  "layers_per_block": 2,
  "norm_num_groups": 32,
  "out_channels": 3,
  "sample_size": 512,
  "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"]
}"""
)
"""runwayml/stable-diffusion-v1-5 vae/config.json (SD 2.1's has sample_size 768)."""

SD15_SCHEDULER_CONFIG = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
"""runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json."""

SD21_SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler",
    "_diffusers_version": "0.8.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
"""stabilityai/stable-diffusion-2-1 scheduler/scheduler_config.json."""

TINY_TEXT_WIDTH = {"sd15": 32, "sd21": 48}
"""Hidden size of the tiny CLIP text encoders = the tiny U-Nets' cross_attention_dim."""

TEXT_TOKENS = 77  # CLIP's model_max_length, kept at the real value


def tiny_unet_config(variant: str) -> dict:
    """The shipped SD 1.5 / 2.1 U-Net config with 32-64 channel levels, one resnet per level, a narrow text width.

    sd15: 8 heads dividing every level (4 and 8 channels per head). sd21: heads [5, 10, 20, 20] that do not divide
    the tiny widths (channels // heads per head, so the attention width differs from the block width).
    """
    config = copy.deepcopy({"sd15": SD15_UNET_CONFIG, "sd21": SD21_UNET_CONFIG}[variant])
    del config["_diffusers_version"]  # diffusers warns about pre-0.9 configs with a small sample_size
    config.update(
        block_out_channels=[32, 64, 64, 64] if variant == "sd15" else [32, 64, 64, 96],
        layers_per_block=1,
        cross_attention_dim=TINY_TEXT_WIDTH[variant],
        sample_size=8,
    )
    return config


def tiny_vae_config(variant: str) -> dict:
    """SD's VAE config with 32-64 channel levels and one resnet per level (two in the decoder)."""
    config = copy.deepcopy(SD_VAE_CONFIG)
    config.update(block_out_channels=[32, 32, 64, 64], layers_per_block=1, sample_size=32 if variant == "sd15" else 48)
    return config


def randomize_norms(model: nn.Module, seed: int) -> nn.Module:
    """GroupNorm/LayerNorm affines to 1 + 0.3 N(0, 1) and 0.3 N(0, 1) (default init leaves them 1 and 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.GroupNorm, nn.LayerNorm)) and module.weight is not None:
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=generator))
    return model


def make_diffusers_unet(config: dict, seed: int):
    """diffusers' UNet2DConditionModel for ``config`` with default init (seeded) and random norm affines."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return randomize_norms(UNet2DConditionModel.from_config(config), seed).eval()


def make_diffusers_vae(config: dict, seed: int):
    """diffusers' AutoencoderKL for ``config`` with default init (seeded) and random norm affines."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return randomize_norms(AutoencoderKL.from_config(config), seed).eval()


def bytes_to_unicode() -> list[str]:
    """GPT-2 / CLIP byte-level alphabet: one printable character per byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


TINY_MERGES = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("an", "d</w>"), ("o", "f</w>"), ("i", "n")]
TINY_MERGES += [("in", "g</w>"), ("c", "a"), ("ca", "t</w>"), ("o", "n</w>")]


def write_tiny_clip_tokenizer(folder: Path, pad_token: str) -> None:
    """vocab.json / merges.txt / tokenizer_config.json of a byte-level CLIP BPE with a few merges (any text
    tokenizes: every byte and every byte + ``</w>`` is in the vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = bytes_to_unicode()
    tokens = alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in TINY_MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in TINY_MERGES))
    special = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = dict(model_max_length=TEXT_TOKENS, pad_token=pad_token, **special)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_text_side(variant: str, tmp_folder: Path, seed: int):
    """(CLIPTextModel, CLIPTokenizer): SD 1.5's pads with <|endoftext|> and uses quick_gelu; SD 2.1's pads with "!"
    and uses gelu (as OpenCLIP-H does)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    write_tiny_clip_tokenizer(tmp_folder, pad_token="<|endoftext|>" if variant == "sd15" else "!")
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp_folder), local_files_only=True)
    width = TINY_TEXT_WIDTH[variant]
    config = CLIPTextConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=width,
        intermediate_size=2 * width + 5,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TEXT_TOKENS,
        hidden_act="quick_gelu" if variant == "sd15" else "gelu",
        projection_dim=width,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModel(config).eval(), tokenizer


def make_tiny_sd_pipeline(variant: str, tmp_folder: Path, seed: int = 0):
    """A diffusers StableDiffusionPipeline with the tiny ``variant`` ("sd15" or "sd21") components (fp32, CPU)."""
    from diffusers import DDIMScheduler, PNDMScheduler, StableDiffusionPipeline

    text_encoder, tokenizer = make_tiny_text_side(variant, tmp_folder, seed)
    scheduler_class, scheduler_config = {
        "sd15": (PNDMScheduler, SD15_SCHEDULER_CONFIG),
        "sd21": (DDIMScheduler, SD21_SCHEDULER_CONFIG),
    }[variant]
    return StableDiffusionPipeline(
        vae=make_diffusers_vae(tiny_vae_config(variant), seed + 1),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=make_diffusers_unet(tiny_unet_config(variant), seed + 2),
        scheduler=scheduler_class.from_config(scheduler_config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def write_tiny_sd_pipeline(
    root: Path, variant: str = "sd15", seed: int = 0, safe_serialization: bool = True, half: bool = False
):
    """Save a tiny ``variant`` StableDiffusionPipeline directory at ``root``; returns the diffusers pipeline (fp32).

    ``safe_serialization=False`` writes .bin files; ``half=True`` writes fp16 weights (the returned pipeline then
    holds the fp16-rounded weights in fp32, i.e. exactly what a loader reading the files in fp32 gets).
    """
    root = Path(root)
    pipe = make_tiny_sd_pipeline(variant, root.parent / f"{root.name}-tokenizer-source", seed)
    if half:
        pipe.to(torch.float16)
    pipe.save_pretrained(str(root), safe_serialization=safe_serialization)
    return pipe.to(torch.float32)
