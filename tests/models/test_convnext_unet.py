"""ConvNeXtUNet: shapes, a functional re-computation of the model, gates, time conditioning, save/load."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet
from fastdiff.models.convnext_unet import (
    CONVNEXT_PRESETS,
    ConvNeXtBlock,
    ConvNeXtUNet,
    ConvNeXtUNetConfig,
    convnext_unet_from_dir,
    save_convnext_unet,
    timestep_embedding,
)

SMALL = dict(in_channels=3, out_channels=2, base_dim=6, dim_mults=(1, 3), attention_heads=2, attention_head_dim=5)


def small_model(seed: int = 0, **overrides) -> ConvNeXtUNet:
    torch.manual_seed(seed)
    config = ConvNeXtUNetConfig(**{"sample_size": 12, **SMALL, **overrides})
    model = ConvNeXtUNet(config).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    return ((out - ref).norm() / ref.norm()).item()


# ---- plain-torch reference: explicit layer norm, erf GELU, softmax attention, wiring as in the module doc


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _norm(norm, x):
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    var = x.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight[:, None, None] + norm.bias[:, None, None]


def _conv(conv, x, **kw):
    return F.conv2d(x, conv.weight, conv.bias, stride=conv.stride, padding=conv.padding, groups=conv.groups, **kw)


def _block_ref(block, x, temb):
    cond = _gelu(temb) @ block.time_proj.weight.t() + block.time_proj.bias
    h = _conv(block.depthwise, x) + cond[:, :, None, None]
    h = _conv(block.conv2, _norm(block.norm2, _gelu(_conv(block.conv1, _norm(block.norm1, h)))))
    res = x if isinstance(block.res_conv, torch.nn.Identity) else _conv(block.res_conv, x)
    return h + res


def _attn_ref(attn, x):
    b, c, hh, ww = x.shape
    qkv = _conv(attn.to_qkv, _norm(attn.norm, x)).reshape(b, 3, attn.heads, attn.head_dim, hh * ww)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [B, heads, d, N]
    weights = torch.softmax(torch.einsum("bhdi,bhdj->bhij", q, k) / math.sqrt(attn.head_dim), dim=-1)
    out = torch.einsum("bhij,bhdj->bhdi", weights, v).reshape(b, -1, hh, ww)
    return x + _conv(attn.to_out, out)


def _gate_ref(gate, skip, g):
    a = torch.relu(_conv(gate.gate_conv, g) + _conv(gate.residual_conv, skip))
    return skip / (1.0 + torch.exp(-_conv(gate.psi, a)))


def _model_ref(model, x, t):
    dim = model.config.base_dim
    half = dim // 2
    args = t.double()[:, None] * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    emb = torch.cat([args.sin(), args.cos(), torch.zeros(len(t), dim % 2, dtype=torch.float64)], 1).float()
    lin1, lin2 = model.time_mlp[0], model.time_mlp[2]
    temb = _gelu(emb @ lin1.weight.t() + lin1.bias) @ lin2.weight.t() + lin2.bias
    h, skips = _conv(model.init_conv, x), []
    for level in model.downs:
        h = _block_ref(level["block2"], _block_ref(level["block1"], h, temb), temb)
        skips.append(h)
        if "downsample" in level:
            h = _conv(level["downsample"], h)
    h = _block_ref(model.mid_block1, h, temb)
    if model.mid_attn is not None:
        h = _attn_ref(model.mid_attn, h)
    h = _block_ref(model.mid_block2, h, temb)
    for level in model.ups:
        h = torch.cat([h, _gate_ref(level["gate"], skips.pop(), h)], dim=1)
        h = _block_ref(level["block2"], _block_ref(level["block1"], h, temb), temb)
        if "upsample" in level:
            h = _conv(level["upsample"], h.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3))
    return _conv(model.final_conv, _block_ref(model.final_block, h, temb))


# ---- tests


@pytest.mark.parametrize(
    ("overrides", "shape"),
    [
        ({}, (3, 3, 12, 12)),
        ({"base_dim": 5, "dim_mults": (1, 2, 3), "sample_size": 20}, (1, 3, 20, 20)),
        ({"dim_mults": (1, 3), "attention": False, "sample_size": 24}, (2, 3, 24, 20)),
        (
            {"in_channels": 1, "out_channels": 1, "base_dim": 4, "dim_mults": (1, 2, 2), "sample_size": 32},
            (3, 1, 32, 32),
        ),
        ({"base_dim": 4, "dim_mults": (1, 1, 2, 2), "sample_size": 64, "gate_reduction": 3}, (1, 3, 64, 64)),
    ],
)
def test_forward_matches_functional_reference(overrides, shape):
    model = small_model(seed=sum(shape), **overrides)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    t = torch.randint(0, 1000, (shape[0],), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(x, t)
        ref = _model_ref(model, x, t)
    assert out.shape == (shape[0], model.config.out_channels, *shape[2:])
    assert rel_err(out, ref) < 1e-5


def test_block_matches_functional_and_attention_matches_softmax():
    torch.manual_seed(3)
    for dim_in, dim_out in ((5, 7), (6, 6)):
        block = ConvNeXtBlock(dim_in, dim_out, time_dim=11, mult=3)
        x, temb = torch.randn(2, dim_in, 9, 7), torch.randn(2, 11)
        with torch.no_grad():
            assert rel_err(block(x, temb), _block_ref(block, x, temb)) < 1e-6
    attn = small_model().mid_attn
    x = torch.randn(2, 18, 6, 5)
    with torch.no_grad():
        assert rel_err(attn(x), _attn_ref(attn, x)) < 1e-6


def test_timestep_embedding_matches_diffusers():
    diffusers_embeddings = pytest.importorskip("diffusers.models.embeddings")
    t = torch.tensor([0.0, 1.0, 37.5, 999.0])
    for dim in (6, 32, 7):
        ref = diffusers_embeddings.get_timestep_embedding(t, dim, flip_sin_to_cos=False, downscale_freq_shift=0)
        ours = timestep_embedding(t, dim)
        assert ours.shape == (4, dim)
        torch.testing.assert_close(ours[:, : 2 * (dim // 2)], ref[:, : 2 * (dim // 2)], rtol=1e-5, atol=1e-5)
        if dim % 2:
            assert (ours[:, -1] == 0).all()


def test_timestep_changes_output_and_scalar_broadcasts():
    model = small_model()
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        early, late = model(x, torch.full((3,), 10)), model(x, torch.full((3,), 900))
        assert rel_err(early, late) > 1e-2
        torch.testing.assert_close(model(x, 10), early, rtol=0, atol=0)
        torch.testing.assert_close(model(x, torch.tensor([10])), early, rtol=0, atol=0)
        torch.testing.assert_close(model(x, torch.tensor(10.0)), early, rtol=0, atol=0)


def test_gate_hand_computation_and_closing():
    gate = small_model().ups[0]["gate"]  # skip 18 channels, gate signal 18 channels, 9 inter channels
    skip, g = torch.randn(2, 18, 3, 5), torch.randn(2, 18, 3, 5)
    with torch.no_grad():
        a = torch.einsum("oc,bchw->bohw", gate.gate_conv.weight[:, :, 0, 0], g) + gate.gate_conv.bias[:, None, None]
        a = a + torch.einsum("oc,bchw->bohw", gate.residual_conv.weight[:, :, 0, 0], skip)
        a = (a + gate.residual_conv.bias[:, None, None]).clamp_min(0)
        psi = (a * gate.psi.weight[0, :, 0, 0][:, None, None]).sum(1, keepdim=True) + gate.psi.bias
        expected = skip * torch.sigmoid(psi)
        assert rel_err(gate(skip, g), expected) < 1e-6
        assert 0 < gate(skip, g).abs().sum() < skip.abs().sum()

    model = small_model()
    captured = []
    for level in model.ups:
        level["gate"].register_forward_hook(lambda mod, args, out: captured.append((args[0], out)))
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        before = model(x, 5)
        for level in model.ups:
            level["gate"].psi.bias.fill_(-40.0)
        captured.clear()
        after = model(x, 5)
    assert len(captured) == 2
    for skip_in, gated in captured:
        assert skip_in.abs().max() > 0.1 and gated.abs().max() < 1e-12
    assert rel_err(after, before) > 1e-3


def test_save_load_round_trip_fp32_and_fp16(tmp_path):
    model = small_model(seed=4)
    x, t = torch.randn(2, 3, 12, 12), torch.tensor([3, 700])
    scheduler = {
        "_class_name": "DDPMScheduler",
        "prediction_type": "v_prediction",
        "num_train_timesteps": 1000,
    }
    save_convnext_unet(model, tmp_path / "fp32", scheduler_config=scheduler)
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == [
        "config.json", "model.safetensors", "scheduler_config.json"
    ]  # fmt: skip
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["_class_name"] == "ConvNeXtUNet" and config["dim_mults"] == [1, 3]
    loaded = load_unet(tmp_path / "fp32")
    assert isinstance(loaded, ConvNeXtUNet) and loaded.config == model.config
    assert loaded.scheduler_config == scheduler
    with torch.no_grad():
        ref = model(x, t)
        assert torch.equal(loaded(x, t), ref)

    save_convnext_unet(model, tmp_path / "fp16", dtype=torch.float16)
    assert all(v.dtype == torch.float16 for v in load_file(tmp_path / "fp16" / "model.safetensors").values())
    half = convnext_unet_from_dir(tmp_path / "fp16", json.loads((tmp_path / "fp16" / "config.json").read_text()))
    rounded = small_model(seed=4)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.half().float())
        out = half(x, t)
        assert torch.equal(out, rounded(x, t))
        assert rel_err(out, ref) < 2e-3  # fp16 rounding of the weights alone gives ~1.2e-3 here


def test_failed_save_leaves_previous_directory_intact(tmp_path):
    model = small_model()
    save_convnext_unet(model, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(TypeError):
        save_convnext_unet(small_model(seed=9), tmp_path, scheduler_config={"bad": object()})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_load_errors(tmp_path):
    model = small_model()
    save_convnext_unet(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    state = load_file(tmp_path / "model.safetensors")

    with pytest.raises(FastdiffError, match="unknown ConvNeXtUNet config key 'num_levels'"):
        convnext_unet_from_dir(tmp_path, {**config, "num_levels": 3})
    with pytest.raises(FastdiffError, match="base_dim must be positive"):
        convnext_unet_from_dir(tmp_path, {**config, "base_dim": 0})
    with pytest.raises(FastdiffError, match="has shape"):
        convnext_unet_from_dir(tmp_path, {**config, "base_dim": 8})
    del state["final_conv.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(FastdiffError, match="missing, first: final_conv.bias"):
        load_unet(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FastdiffError, match="no weights"):
        load_unet(tmp_path)


def test_bad_inputs_raise():
    model = small_model()
    with pytest.raises(FastdiffError, match="divisible by 2"):
        model(torch.randn(1, 3, 12, 11), 1)
    with pytest.raises(FastdiffError, match=r"\[B, 3, H, W\]"):
        model(torch.randn(1, 2, 12, 12), 1)
    with pytest.raises(FastdiffError, match="timesteps"):
        model(torch.randn(3, 3, 12, 12), torch.tensor([1, 2]))
    with pytest.raises(FastdiffError, match="sample_size 20 is not divisible"):
        ConvNeXtUNetConfig(sample_size=20, dim_mults=(1, 2, 2, 2))


def test_presets_sizes():
    assert set(CONVNEXT_PRESETS) == {"fashion-mnist", "convnext-cifar10", "convnext-64"}
    fashion = CONVNEXT_PRESETS["fashion-mnist"]
    assert (fashion.in_channels, fashion.out_channels, fashion.sample_size) == (1, 1, 32)
    params = sum(p.numel() for p in ConvNeXtUNet(fashion).parameters())
    assert 3e6 <= params <= 8e6 and 2 * params <= 25e6
    assert CONVNEXT_PRESETS["convnext-cifar10"].sample_size == 32
    assert CONVNEXT_PRESETS["convnext-64"].sample_size == 64
    with torch.device("meta"):
        assert sum(p.numel() for p in ConvNeXtUNet(CONVNEXT_PRESETS["convnext-cifar10"]).parameters()) < 50e6
    model = ConvNeXtUNet(fashion).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 1, 32, 32), 500)
    assert out.shape == (1, 1, 32, 32) and torch.isfinite(out).all()
