"""The Stable Diffusion families on the engine: the fused UNet2DConditionModel (self/cross attention, LayerNorm,
GEGLU) and the fused VAE decode vs the eager models in float64 (fp32 engine; Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from sd_fixtures import randomize_norms, tiny_unet_config, tiny_vae_config

from fastdiff.engine.executor import FusedModel
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.impl import Impl
from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention import attention_tiles
from fastdiff.kernels.linear import linear_tiles
from fastdiff.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

from .conftest import DEVICE, TOL, rel_err

IRREGULAR_UNET = dict(
    # 3 levels of 12/20/28 channels, heads 2/3/4 (20 // 3 = 6 channels per head: attention width 18 != 20),
    # two transformer layers at the lowest level, linear projections, odd text width and length, DDPM-style
    # downsample padding, centred input, scaled mid block
    in_channels=3, out_channels=3, block_out_channels=[12, 20, 28], norm_num_groups=4, norm_eps=1e-4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], layers_per_block=1,
    attention_head_dim=[2, 3, 4], transformer_layers_per_block=[1, 1, 2], cross_attention_dim=10,
    use_linear_projection=True, flip_sin_to_cos=False, freq_shift=1, center_input_sample=True,
    mid_block_scale_factor=1.3, downsample_padding=0,
)  # fmt: skip

CASES = {
    # name: (config, U-Net batch, latent (H, W), text tokens)
    "sd15": (tiny_unet_config("sd15"), 1, (8, 8), 77),  # SD1.5 structure: 1x1-conv projections, 8 heads
    "sd21": (tiny_unet_config("sd21"), 1, (8, 8), 77),  # SD2.1: linear projections, heads not dividing widths
    "irregular": (IRREGULAR_UNET, 3, (4, 12), 5),
}
"""(Interpreter-sized: the batch-2 and 64x64 shapes run in the GPU tests.)"""


def make_unet(config: dict, seed: int) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    cfg = UNet2DConditionConfig.from_dict({k: v for k, v in config.items() if not k.startswith("_")})
    return randomize_norms(UNet2DConditionModel(cfg), seed).eval()


@pytest.mark.parametrize(
    "impls",
    [("triton", "triton"), pytest.param(("cudnn", "sdpa"), marks=pytest.mark.slow),
     pytest.param(("triton", "triton", "last tiles"), marks=pytest.mark.slow)],
)  # fmt: skip
@pytest.mark.parametrize("name", [n if n == "sd15" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)])
def test_fused_unet_2d_condition_matches_eager(name, impls):
    """The fused U-Net against the eager model in float64; "last tiles": every token GEMM and attention on its
    last tile (``-t...``, a candidate the engine times on CUDA; forced here, in the interpreter too)."""
    config, batch, size, tokens = CASES[name]
    model = make_unet(config, seed=len(name)).to(DEVICE)
    fused = FusedModel(model, batch, torch.float32, DEVICE, *impls[:2], size=size, context_tokens=tokens)
    if len(impls) > 2:
        for op in fused.ops:
            if op.kind == "linear":
                n, _, h, w = op.inputs[0].shape
                fused.impls[op.name] = Impl("triton", tile=linear_tiles(n * h * w)[-1])
            elif op.kind == "attention":
                q = op.inputs[0].shape
                fused.impls[op.name] = Impl("triton", tile=attention_tiles(op.params["head_dim"], q[2] * q[3])[-1])
    fused.arena.view(torch.float32).fill_(float("nan"))
    kinds = {op.kind for op in fused.ops}
    assert {"layer_norm", "linear", "attention"} <= kinds
    assert len(fused.context_ops) == sum(op.params.get("cross", False) for op in fused.ops)  # one K/V per block
    gen = torch.Generator().manual_seed(3)
    shape = fused.x_in_value.shape
    steps = (981, 20) if name == "irregular" else (981,)  # a second call: no weight waits, a new context
    for t in steps:
        x = torch.randn(shape, generator=gen)
        context = torch.randn((batch, tokens, model.config.cross_attention_dim), generator=gen)
        x_in = channels_last_empty(shape, torch.float32, DEVICE).copy_(x.to(DEVICE))
        out = fused.forward(x_in, torch.tensor([t], device=DEVICE), context.to(DEVICE))
        with torch.no_grad():
            ref = model.double().cpu()(x.double(), torch.tensor([t]), context.double())
            model.to(DEVICE, torch.float32)
        assert rel_err(out, ref) < TOL, name
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.slow
def test_fused_unet_context_is_projected_once_per_set_context():
    config, batch, size, tokens = IRREGULAR_UNET, 1, (4, 4), 5
    model = make_unet(config, seed=1).to(DEVICE)
    fused = FusedModel(model, batch, torch.float32, DEVICE, "triton", "triton", size=size, context_tokens=tokens)
    x_in = channels_last_empty(fused.x_in_value.shape, torch.float32, DEVICE).normal_()
    context = torch.randn((batch, tokens, model.config.cross_attention_dim), device=DEVICE)
    t = torch.tensor([500], device=DEVICE)
    first = fused.forward(x_in, t, context).clone()
    kv = next(iter(fused.persistent.values())).clone()
    fused.set_context(2 * context)
    assert not torch.equal(next(iter(fused.persistent.values())), kv)  # the K/V follow the new context
    second = fused.forward(x_in, t).clone()  # no context: the last one set
    fused.set_context(context)
    assert torch.equal(fused.forward(x_in, t), first)
    assert not torch.equal(second, first)
    with pytest.raises(FastdiffError, match="do not match the prepared"):
        fused.set_context(context[:, :3])


def test_unet_latent_size_must_fit_the_levels():
    config, _, _, _ = CASES["sd15"]
    with pytest.raises(FastdiffError, match="multiples of 8 .images in multiples of 64 pixels.; got 12x8"):
        FusedModel(make_unet(config, 0), 2, torch.float32, DEVICE, "triton", "triton", size=(12, 8))


@pytest.mark.slow
@pytest.mark.parametrize("post_quant_conv", [True, False])
def test_fused_vae_decode_matches_eager(post_quant_conv):
    config = tiny_vae_config("sd15")
    config.update(use_post_quant_conv=post_quant_conv, scaling_factor=0.3)
    torch.manual_seed(5)
    vae = randomize_norms(AutoencoderKL(AutoencoderKLConfig.from_dict(config)), 5).eval().to(DEVICE)
    fused = FusedModel(vae, 2, torch.float32, DEVICE, "triton", "triton", size=(3, 5))
    fused.arena.view(torch.float32).fill_(float("nan"))
    latents = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    x_in = channels_last_empty((2, 4, 3, 5), torch.float32, DEVICE).copy_(latents.to(DEVICE))
    out = fused.forward(x_in)
    with torch.no_grad():
        ref = vae.double().cpu().decode(latents.double() / 0.3)
    assert out.shape == (2, 3, 24, 40)
    assert rel_err(out, ref) < TOL
    assert {op.kind for op in fused.ops} == {"conv", "group_norm", "attention"}


@pytest.mark.slow
def test_bundled_text_to_image_model_on_the_engine():
    """The bundled fashion-mnist-t2i model (trained weights: a 3-level U-Net on 16x16x4 latents, a one-channel 2x
    VAE) through the fused U-Net (guided batch of 2, its own 77-token text states) and the fused VAE decode."""
    pytest.importorskip("transformers")
    from fastdiff.models.stable_diffusion import load_stable_diffusion

    comps = load_stable_diffusion("fashion-mnist-t2i")
    unet, vae = comps.unet.to(DEVICE), comps.vae.to(DEVICE)
    side = unet.config.sample_size  # the latents' side (16)
    fused = FusedModel(unet, 2, torch.float32, DEVICE, "triton", "triton", context_tokens=77)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((2, 4, side, side), generator=gen)
    context = torch.randn((2, 77, unet.config.cross_attention_dim), generator=gen)
    x_in = channels_last_empty((2, 4, side, side), torch.float32, DEVICE).copy_(x.to(DEVICE))
    out = fused.forward(x_in, torch.tensor([700], device=DEVICE), context.to(DEVICE))
    with torch.no_grad():
        ref = unet.double().cpu()(x.double(), torch.tensor([700]), context.double())
    assert rel_err(out, ref) < TOL
    decoder = FusedModel(vae, 1, torch.float32, DEVICE, "triton", "triton", size=(side, side))
    latents = torch.randn((1, 4, side, side), generator=gen)
    z_in = channels_last_empty((1, 4, side, side), torch.float32, DEVICE).copy_(latents.to(DEVICE))
    image = decoder.forward(z_in)
    with torch.no_grad():
        ref_image = vae.double().cpu().decode(latents.double() / vae.config.scaling_factor)
    assert image.shape == (1, 1, 32, 32)
    assert rel_err(image, ref_image) < TOL


@pytest.mark.slow
def test_engine_decode_returns_a_fresh_tensor_and_times_each_model():
    from fastdiff.engine import Engine

    config = tiny_vae_config("sd15")
    torch.manual_seed(2)
    vae = randomize_norms(AutoencoderKL(AutoencoderKLConfig.from_dict(config)), 2).eval().to(DEVICE)
    engine = Engine(DEVICE, conv_impl="triton", attention_impl="triton")
    a, b = (torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    first = engine.decode(vae, a, torch.float32)
    kept = first.clone()
    second = engine.decode(vae, b, torch.float32)
    assert torch.equal(first, kept) and not torch.equal(first, second)  # the graph's buffer is not handed out
    assert {"decoder_first_forward_s", "decoder_autotune_s"} <= set(engine.timings)
    assert "step_first_forward_s" not in engine.timings


@pytest.mark.slow  # 54 s in the interpreter; the kernel's own tile tests (tests/kernels/test_linear.py) stay fast
@pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs a Hopper-class GPU"
)
def test_token_gemms_on_the_tma_kernel(monkeypatch):
    """Every token GEMM of the SD 1.5-structured U-Net (fp16) on the TMA form of the linear kernel
    (``triton-tma``, a candidate on Hopper; forced here, in the interpreter too): the pointer kernel's result."""
    import fastdiff.kernels.linear as linear_module

    config, _, size, tokens = CASES["sd15"]
    model = make_unet(config, seed=4).to(DEVICE)
    context = torch.randn((2, tokens, model.config.cross_attention_dim), device=DEVICE).half()
    t = torch.tensor([700], device=DEVICE)
    launches = []
    tma_kernel = linear_module._linear_tma_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return tma_kernel[grid]

    monkeypatch.setattr(linear_module, "_linear_tma_kernel", Counting())
    outs = []
    for tma in (False, True):
        fused = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton", size=size, context_tokens=tokens)
        linears = [op.name for op in fused.ops if op.kind == "linear"]
        if tma:
            fused.impls.update({name: Impl("triton-tma") for name in linears})
        x_in = channels_last_empty(fused.x_in_value.shape, torch.float16, DEVICE)
        x_in.copy_(torch.randn(x_in.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE))
        outs.append(fused.forward(x_in, t, context).clone())
        assert (len(launches) > 0) == tma
    assert len(linears) > 20 and len(launches) >= len(linears)
    assert rel_err(outs[1], outs[0]) < 2e-3


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the SD 1.5 shapes and the GPU's allocator: GPU only")
def test_sd15_engine_fp16_image_with_weights_drawn_on_the_gpu_matches_eager():
    """SD 1.5's random weights drawn on the GPU (as ``fastdiff bench --model sd15`` draws them) through the fp16
    engine, its shortcut pairs fused (``-sc``, as the shipped plan says), against eager fp16: finite,
    and close. On the H100 at git 3b2fa73 this image was all NaN: the fused pairs' bias was summed before its uploads
    had landed, reading what the GPU draw had left in that memory (docs/engine/nan-with-gpu-drawn-weights.md)."""
    import copy

    from fastdiff.models.stable_diffusion import random_components
    from fastdiff.pipelines.text_to_image import TextToImagePipeline
    from fastdiff.quality.psnr import psnr

    comps = random_components("sd15", 0, DEVICE)
    latents = torch.randn((1, 4, 64, 64), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    images = {}
    for backend in ("eager", "engine"):
        parts = copy.copy(comps)
        parts.text_encoder = copy.deepcopy(comps.text_encoder).to(DEVICE, torch.float16)
        parts.vae = copy.deepcopy(comps.vae).to(DEVICE, torch.float16)
        parts.unet = copy.deepcopy(comps.unet).to(DEVICE if backend == "eager" else "cpu", torch.float16)
        pipe = TextToImagePipeline(parts, sampler="ddim", steps=20, device=DEVICE, dtype=torch.float16,
                                   backend=backend, tune="off")  # the shipped plan, no minutes of tuning  # fmt: skip
        call = dict(guidance_scale=7.5, latents=latents, output_type="pt", progress=False)
        images[backend] = pipe(["a photograph of an astronaut riding a horse"], **call)
    fused = pipe.engine.current_step_model
    assert fused.pairs["sc"]
    if not any(fused.impls[name].fuses("sc") for name in fused.pairs["sc"]):
        pytest.skip("no shipped plan binds a -sc pair on this GPU")
    assert torch.isfinite(images["engine"]).all()
    assert float(psnr(images["engine"].float(), images["eager"].float(), data_range=1.0).mean()) > 50
