"""load_stable_diffusion on tiny StableDiffusionPipeline directories saved by diffusers: prompt embeddings equal to
diffusers' encode_prompt, U-Net / VAE outputs equal to the pipeline's, and a one-line error for every broken piece."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from sd_fixtures import write_tiny_sd_pipeline

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet
from fastdiff.models.stable_diffusion import (
    PIPELINE_PARTS,
    SD_PRESETS,
    encode_prompts,
    load_stable_diffusion,
)
from fastdiff.models.unet_2d_condition import UNet2DConditionModel

TOL = 1e-4  # fp32 max abs diff; observed <= 2e-6

LONG_PROMPT = "a cat and the thing of " * 30  # far more than 77 tokens: truncated
PROMPTS = ["a photograph of an astronaut riding a horse", "", LONG_PROMPT]


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """(directory, diffusers pipeline): tiny SD 1.5, fp32 safetensors."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("sd15") / "pipeline"
    return root, write_tiny_sd_pipeline(root, "sd15", seed=11)


@pytest.fixture(scope="module")
def sd21(tmp_path_factory):
    """(directory, diffusers pipeline): tiny SD 2.1, fp16 weights in .bin files (text encoder included)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("sd21") / "pipeline"
    pipe = write_tiny_sd_pipeline(root, "sd21", seed=12, safe_serialization=False, half=True)
    text_weights = root / "text_encoder" / "model.safetensors"
    if text_weights.exists():  # recent transformers always write safetensors
        torch.save(load_file(str(text_weights)), str(root / "text_encoder" / "pytorch_model.bin"))
        text_weights.unlink()
    return root, pipe


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", ["sd15", "sd21"])
def test_components_match_diffusers(variant, request, caplog):
    root, pipe = request.getfixturevalue(variant)
    parts = load_stable_diffusion(root)
    assert parts.model_index["_class_name"] == "StableDiffusionPipeline"
    expected_scheduler = {"sd15": "PNDMScheduler", "sd21": "DDIMScheduler"}[variant]
    assert parts.scheduler_config["_class_name"] == expected_scheduler
    assert parts.unet.scheduler_config is parts.scheduler_config
    assert isinstance(parts.unet, UNet2DConditionModel)
    for module in (parts.unet, parts.vae, parts.text_encoder):
        assert all(p.dtype == torch.float32 for p in module.parameters())

    with caplog.at_level("WARNING", logger="fastdiff.models.stable_diffusion"):
        states = encode_prompts(parts.text_encoder, parts.tokenizer, PROMPTS, "cpu")
    assert "truncated" in caplog.text
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(PROMPTS, "cpu", 1, False)
    assert states.shape == (3, 77, pipe.text_encoder.config.hidden_size)
    assert max_abs(states, expected) <= 1e-5

    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(3, 4, 6, 10, generator=gen)
    t = torch.tensor([999, 500, 1])
    with torch.no_grad():
        assert max_abs(parts.unet(latents, t, states), pipe.unet(latents, t, expected).sample) <= TOL
        scaled = latents / parts.vae.config.scaling_factor
        assert max_abs(parts.vae.decode(scaled), pipe.vae.decode(scaled).sample) <= TOL


def test_dtype_and_load_unet(sd15):
    root, _ = sd15
    parts = load_stable_diffusion(root, dtype=torch.bfloat16)
    for module in (parts.unet, parts.vae, parts.text_encoder):
        assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert encode_prompts(parts.text_encoder, parts.tokenizer, ["a cat"], "cpu").dtype == torch.bfloat16
    unet = load_unet(root)  # the pipeline directory's unet/ with its scheduler/ config
    assert isinstance(unet, UNet2DConditionModel)
    assert unet.scheduler_config["_class_name"] == "PNDMScheduler"


def test_presets_are_sd_architectures():
    assert SD_PRESETS["sd15"].unet.cross_attention_dim == 768
    assert SD_PRESETS["sd21"].unet.attention_head_dim == (5, 10, 20, 20)
    assert SD_PRESETS["sd21"].unet.use_linear_projection and SD_PRESETS["sd21"].unet.upcast_attention
    assert SD_PRESETS["sd15"].text_tokens == 77


def linked_copy(sd15, tmp_path):
    """A hard-linked copy of the tiny SD 1.5 directory (replace a file by unlinking it first)."""
    root = tmp_path / "copy"
    shutil.copytree(sd15[0], root, copy_function=os.link)
    return root


def rewrite(file, text: str) -> None:
    file.unlink()
    file.write_text(text)


def expect_error(root, *words: str) -> str:
    with pytest.raises(FastdiffError) as info:
        load_stable_diffusion(root)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


@pytest.mark.parametrize("part", PIPELINE_PARTS)
def test_each_missing_part(part, sd15, tmp_path):
    root = linked_copy(sd15, tmp_path)
    if part.endswith("/"):
        shutil.rmtree(root / part)
    else:
        (root / part).unlink()
    message = expect_error(root)
    assert message == (
        f"{root}: missing {part} (a StableDiffusionPipeline directory needs model_index.json, unet/, vae/, "
        "text_encoder/, tokenizer/, scheduler/)"
    )


def edit_model_index(root, **changes) -> None:
    index = json.loads((root / "model_index.json").read_text())
    rewrite(root / "model_index.json", json.dumps({**index, **changes}))


def test_broken_pieces(sd15, tmp_path):
    expect_error(tmp_path / "nowhere", "not found")
    (tmp_path / "file").write_text("")
    expect_error(tmp_path / "file", "not a directory")

    root = linked_copy(sd15, tmp_path)
    rewrite(root / "model_index.json", "{not json")
    expect_error(root, "model_index.json is not valid JSON")
    rewrite(root / "model_index.json", "[1, 2]")
    expect_error(root, "model_index.json: expected a JSON object")

    root = linked_copy(sd15, tmp_path / "a")
    edit_model_index(root, _class_name="StableDiffusionXLPipeline")
    expect_error(root, "pipeline class 'StableDiffusionXLPipeline' is not supported")
    edit_model_index(root, _class_name="StableDiffusionPipeline", text_encoder=["transformers", "T5EncoderModel"])
    expect_error(root, "text_encoder class 'T5EncoderModel' is not supported")
    edit_model_index(root, text_encoder=None)
    expect_error(root, "'text_encoder' must be a [library, class] pair")

    root = linked_copy(sd15, tmp_path / "b")
    (root / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    expect_error(root, "no weights in", "unet")
    root = linked_copy(sd15, tmp_path / "c")
    config = json.loads((root / "unet" / "config.json").read_text())
    rewrite(root / "unet" / "config.json", json.dumps({**config, "_class_name": "UNet2DModel"}))
    expect_error(root, "model class 'UNet2DModel' is not supported")
    root = linked_copy(sd15, tmp_path / "d")
    (root / "text_encoder" / "model.safetensors").unlink()
    expect_error(root, "no weights in", "text_encoder")
    root = linked_copy(sd15, tmp_path / "e")
    for file in (root / "tokenizer").iterdir():
        file.unlink()
    expect_error(root, "tokenizer files missing")
    root = linked_copy(sd15, tmp_path / "f")
    (root / "scheduler" / "scheduler_config.json").unlink()
    expect_error(root, "missing", "scheduler_config.json")
    root = linked_copy(sd15, tmp_path / "g")
    config = json.loads((root / "text_encoder" / "config.json").read_text())
    rewrite(root / "text_encoder" / "config.json", "{}")  # transformers' default architecture: not these weights
    expect_error(root, "text_encoder: ", "weights missing")
    rewrite(root / "text_encoder" / "config.json", json.dumps({**config, "hidden_act": "relu"}))
    expect_error(root, "text_encoder/config.json: unsupported hidden_act='relu'")


def test_loads_without_transformers_and_explains_a_missing_tokenizers(sd15, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    parts = load_stable_diffusion(sd15[0])  # the text encoder and tokenizer are fastdiff's own
    assert encode_prompts(parts.text_encoder, parts.tokenizer, ["a cat"], "cpu").shape[:2] == (1, 77)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    expect_error(sd15[0], "needs the tokenizers package", "pip install 'fastdiff[sd]'")


def test_encode_prompts_rejects_a_bare_string(sd15):
    parts = load_stable_diffusion(sd15[0])
    with pytest.raises(FastdiffError, match="non-empty list of strings"):
        encode_prompts(parts.text_encoder, parts.tokenizer, "a cat", "cpu")
