"""fastdiff's CLIP text tower against transformers' ``CLIPTextModel``: the text_encoder/config.json files that SD 1.5
and SD 2.1 ship (quick_gelu / gelu, 12 / 23 layers), every parameter random (LayerNorm affines and biases too), read
from the files transformers writes, from the hub's older layout, and from shards; and what fastdiff writes, read
back by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.models.clip_text import CLIPTextConfig, CLIPTextModel, clip_text_from_dir, save_clip_text

transformers = pytest.importorskip("transformers")

SD15_TEXT_CONFIG_JSON = {
    "_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPTextModel"], "attention_dropout": 0.0,
    "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768,
    "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768, "torch_dtype": "float32",
    "transformers_version": "4.22.0.dev0", "vocab_size": 49408,
}  # fmt: skip
"""runwayml/stable-diffusion-v1-5 text_encoder/config.json."""
SD21_TEXT_CONFIG_JSON = {
    **SD15_TEXT_CONFIG_JSON, "_name_or_path": "hf-models/stable-diffusion-v2-768x768/text_encoder",
    "hidden_act": "gelu", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
    "num_hidden_layers": 23, "projection_dim": 512, "transformers_version": "4.25.0.dev0",
}  # fmt: skip
"""stabilityai/stable-diffusion-2-1 text_encoder/config.json."""
CONFIGS = {"sd15": SD15_TEXT_CONFIG_JSON, "sd21": SD21_TEXT_CONFIG_JSON}
TOL = 1e-4  # fp32 max abs diff of LayerNorm-ed outputs (O(1)); observed 0 (the same ops in the same order)


def reference(config_json: dict, seed: int = 0):
    """transformers' model on ``config_json``, every parameter drawn at a scale where each layer changes h."""
    keys = {k: v for k, v in config_json.items() if not k.startswith("_") and k != "architectures"}
    model = transformers.CLIPTextModel(transformers.CLIPTextConfig(**keys)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "layer_norm" in name else p.shape[-1] ** -0.5 if p.ndim == 2 else 0.1
            base = 1.0 if "layer_norm" in name and name.endswith("weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return model


def prompt_ids(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """Token ids as a CLIP tokenizer lays them out: start token, words, end token, then end-token padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    ids[:, 0] = 0
    for row in range(batch):
        ids[row, 2 + 5 * row :] = 2
    return ids


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    """(name, transformers' model, the folder it saved itself to)."""
    model = reference(CONFIGS[request.param])
    folder = tmp_path_factory.mktemp(f"clip-{request.param}")
    model.save_pretrained(folder)
    return request.param, model, folder


@pytest.mark.parametrize("length", [77, 13, 1], ids=["sd-length", "odd-length", "one-token"])
def test_matches_transformers(saved, length):
    name, ref, folder = saved
    ours = clip_text_from_dir(folder)
    assert ours.config.hidden_act == CONFIGS[name]["hidden_act"]
    ids = prompt_ids(3, length, CONFIGS[name]["vocab_size"])
    with torch.no_grad():
        want, got = ref(ids)[0], ours(ids)[0]
    assert got.shape == want.shape == (3, length, CONFIGS[name]["hidden_size"])
    assert want.std() > 0.5  # the LayerNorm-ed output, not a near-constant
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_attention_mask_matches_transformers(saved):
    name, ref, folder = saved
    ours = clip_text_from_dir(folder)
    ids = prompt_ids(2, 11, CONFIGS[name]["vocab_size"])
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask)[0], ours(ids, attention_mask=mask)[0]
        unmasked = ours(ids)[0]
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert (got[1, 6:] - unmasked[1, 6:]).abs().max() > 1e-3  # the mask hides the padding keys


def test_hub_layout_and_shards_load(saved, tmp_path):
    """transformers 4's names (``text_model.`` prefix, a ``position_ids`` buffer), in two safetensors shards."""
    from safetensors.torch import save_file

    name, ref, _ = saved
    state = {f"text_model.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    state["text_model.embeddings.position_ids"] = torch.arange(77)[None]
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / file), metadata={"format": "pt"})
    index = {"weight_map": {k: file for file, names in shards.items() for k in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    ids = prompt_ids(2, 77, CONFIGS[name]["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(clip_text_from_dir(tmp_path)(ids)[0], ref(ids)[0], atol=TOL, rtol=0)


def test_what_fastdiff_writes_transformers_reads(saved, tmp_path):
    name, _, folder = saved
    ours = clip_text_from_dir(folder)
    save_clip_text(ours, tmp_path / "text_encoder", torch.float16)
    back = transformers.CLIPTextModel.from_pretrained(str(tmp_path / "text_encoder"), local_files_only=True).eval()
    assert back.dtype == torch.float16
    ids = prompt_ids(2, 77, CONFIGS[name]["vocab_size"])
    with torch.no_grad():
        want = ours.to(torch.float16).float()(ids)[0]  # the same fp16-rounded weights, evaluated in fp32
        torch.testing.assert_close(back.float()(ids)[0], want, atol=TOL, rtol=0)


def test_new_model_draws_transformers_initialisation():
    """The random presets' encoder: the spread of each weight as transformers' ``_init_weights`` sets it."""
    cfg = CLIPTextConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    torch.manual_seed(0)
    ours = CLIPTextModel(cfg)
    keys = {k: v for k, v in cfg.to_dict().items() if k != "architectures"}
    ref = transformers.CLIPTextModel(transformers.CLIPTextConfig(**keys))
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        want = theirs[name]
        assert p.shape == want.shape, name
        assert abs(p.std().item() - want.std().item()) <= 0.1 * want.std().item() + 1e-6, name
        assert abs(p.mean().item() - want.mean().item()) <= 0.05 * (want.std().item() + 1e-3) + 1e-6, name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_act": "relu"}, "unsupported hidden_act='relu'"),
        ({"architectures": ["CLIPTextModelWithProjection"]}, "unsupported architectures"),
        ({"num_attention_heads": 5}, "not a multiple of num_attention_heads 5"),
        ({"hidden_size": "wide"}, "config.json"),
    ],
    ids=["activation", "class", "heads", "bad-value"],
)
def test_configs_it_cannot_run_are_one_line_errors(tmp_path, edit, message):
    (tmp_path / "config.json").write_text(json.dumps({**SD15_TEXT_CONFIG_JSON, **edit}))
    with pytest.raises(FastdiffError, match=message) as err:
        clip_text_from_dir(tmp_path)
    assert "\n" not in str(err.value)


def test_missing_weights_and_shards_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SD15_TEXT_CONFIG_JSON))
    with pytest.raises(FastdiffError, match="no weights in .*model.safetensors"):
        clip_text_from_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    with pytest.raises(FastdiffError, match="names part-1.safetensors, which is missing"):
        clip_text_from_dir(tmp_path)


def test_too_many_tokens_is_refused():
    model = CLIPTextModel(CLIPTextConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=8))  # fmt: skip
    with pytest.raises(FastdiffError, match="9 tokens is more than the text encoder's 8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_use_attention_mask_is_kept():
    """diffusers passes the padding mask to an encoder whose config says ``use_attention_mask`` (as fastdiff's
    ``encode_prompts`` does): the key is a field, not an ignored one."""
    assert not CLIPTextConfig.from_dict(SD15_TEXT_CONFIG_JSON).use_attention_mask
    assert CLIPTextConfig.from_dict({**SD15_TEXT_CONFIG_JSON, "use_attention_mask": True}).use_attention_mask
