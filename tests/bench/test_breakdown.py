"""fastdiff.bench.breakdown: name classification, a CPU profile of a tiny U-Net step, the bar chart."""

from __future__ import annotations

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from fastdiff.bench.breakdown import (
    OP_CLASSES,
    breakdown_figure,
    classify,
    plot_breakdown,
    profile_breakdown,
    sampler_range,
)
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig
from fastdiff.samplers import ScheduleConfig, make_sampler

NAMES = {
    # aten ops
    "aten::convolution": "convolution",
    "aten::cudnn_convolution": "convolution",
    "aten::_slow_conv2d_forward": "convolution",
    "aten::addmm": "convolution",
    "aten::linear": "convolution",
    "aten::native_group_norm": "normalisation",
    "aten::layer_norm": "normalisation",
    "aten::scaled_dot_product_attention": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_efficient_attention_forward": "attention",
    "aten::bmm": "attention",
    "aten::_softmax": "attention",
    "aten::silu": "elementwise",
    "aten::add": "elementwise",
    "aten::mul": "elementwise",
    "aten::copy_": "elementwise",
    "aten::upsample_nearest2d": "elementwise",
    "aten::expand": "other",
    "aten::empty": "other",
    "aten::view": "other",
    "fastdiff.sampler": "sampler",
    # CUDA kernels (cuDNN, cutlass, cuBLAS, torch's own)
    "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1": (
        "convolution"
    ),
    "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688fprop_optimized_tf32_64x64_16x10_nhwc_align4>": (
        "convolution"
    ),
    "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int)": (
        "convolution"
    ),
    "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>(float const*)": (
        "convolution"
    ),
    "ampere_sgemm_32x32_sliced1x4_tn": "convolution",
    "nvjet_sm90_hsh_8x64_64x16_2x1_v_bz_bias_TNN": "convolution",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*)": (
        "normalisation"
    ),
    "void at::native::elementwise_kernel<128, 2, GroupNormKernelImplInternal<float, float>(...)::{lambda()#1}>": (
        "normalisation"
    ),
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::half_t>>": (
        "attention"
    ),
    "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)": "attention",
    "void (anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, false>": "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>": (
        "elementwise"
    ),
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>": "elementwise",
    "Memcpy HtoD (Pageable -> Device)": "transfer",
    "Memcpy DtoH (Device -> Pinned)": "transfer",
    "Memcpy DtoD (Device -> Device)": "elementwise",
    "Memset (Device)": "other",
    # torch.compile (Inductor) Triton kernels
    "triton_poi_fused_add_convolution_silu_0": "convolution",
    "triton_red_fused_native_group_norm_1": "normalisation",
    "triton_per_fused_convolution_native_group_norm_silu_2": "normalisation",
    "triton_per_fused__softmax_3": "attention",
    "triton_tem_fused_addmm_4": "convolution",
    "triton_poi_fused__scaled_dot_product_cudnn_attention__unsafe_view_add_transpose_view_12": "elementwise",
    "triton_poi_fused_cat_mul_5": "elementwise",
    "triton_poi_fused__to_copy_convert_element_type_6": "elementwise",
    # fastdiff engine kernels (src/fastdiff/kernels)
    "_conv2d_kernel": "convolution",
    "_winograd_gemm_kernel": "convolution",
    "_depthwise_kernel": "convolution",
    "_attention_gate_kernel": "convolution",
    "_attention_kernel": "attention",
    "_gn_single_pass_kernel": "normalisation",
    "_gn_apply_kernel": "normalisation",
    "_sampler_step_kernel": "sampler",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_classify(name):
    assert classify(name) == NAMES[name]


def test_names_cover_every_class():
    assert set(NAMES.values()) == set(OP_CLASSES)


def _tiny_step():
    """A tiny attention U-Net (odd channels, non-square) + one DDIM step under the sampler range."""
    torch.manual_seed(0)
    config = DDPMUNetConfig(
        sample_size=(6, 10), in_channels=3, out_channels=3, block_out_channels=(6, 9), norm_num_groups=3,
        down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "AttnUpBlock2D"),
        layers_per_block=1, attention_head_dim=3,
    )  # fmt: skip
    model = DDPMUNet(config).eval()
    sampler = make_sampler("ddim", ScheduleConfig(), 4)
    x = torch.randn(1, 3, 6, 10)

    @torch.no_grad()
    def run_step() -> None:
        out = model(x, sampler.timesteps[0])
        with sampler_range():
            sampler.step(0, x, out, sampler.new_state(x))

    return run_step


def test_profile_breakdown_cpu():
    result = profile_breakdown(_tiny_step(), torch.device("cpu"), steps=2, warmup=1)
    per_class = result["per_class_ms"]
    assert tuple(per_class) == OP_CLASSES
    for cls in ("convolution", "normalisation", "attention", "elementwise", "sampler"):
        assert per_class[cls] > 0, cls
    assert per_class["transfer"] == 0
    assert sum(per_class.values()) == pytest.approx(result["total_ms"], rel=0.01)
    assert 0 < result["total_ms"] <= result["wall_ms"]
    # the classes and the idle remainder make up the profiled step: shares of it never pass 100 %
    assert result["idle_ms"] == pytest.approx(result["wall_ms"] - result["total_ms"])
    assert sum(per_class.values()) + result["idle_ms"] == pytest.approx(result["wall_ms"])
    assert result["kernels_seen"] == 0
    assert "self CPU time" in result["method"]
    events = result["events"]
    assert 0 < len(events) <= 15
    times = [e["ms_per_step"] for e in events]
    assert times == sorted(times, reverse=True)
    assert all(e["class"] in OP_CLASSES and e["calls_per_step"] > 0 for e in events)
    conv = [e for e in events if "conv" in e["name"]]
    assert conv and conv[0]["class"] == "convolution" and conv[0]["input_shapes"]
    assert sum(e["ms_per_step"] for e in events) <= result["total_ms"] * 1.001


ROWS = {
    "eager": {"convolution": 3.0, "normalisation": 1.0, "attention": 0.5, "elementwise": 1.2, "sampler": 0.1},
    "compile": {"convolution": 2.5, "normalisation": 0.6, "attention": 0.4, "elementwise": 0.3, "other": 0.2},
    "engine": dict.fromkeys(OP_CLASSES, 0.25),
}


@pytest.mark.parametrize("rows", [ROWS, {"eager": ROWS["eager"]}], ids=["three_backends", "one_backend"])
def test_breakdown_legend_covers_no_bar(rows):
    fig = breakdown_figure(rows, "tiny U-Net, one step")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = fig.legends + [child for ax in fig.axes if (child := ax.get_legend()) is not None]
    assert len(legends) == 1
    legend = legends[0].get_window_extent(renderer)
    ax = fig.axes[0]
    drawn = [p for p in ax.patches if p.get_width() > 0] + list(ax.texts)
    assert len(drawn) >= len(rows)
    for artist in drawn:
        box = artist.get_window_extent(renderer)
        assert not legend.overlaps(box), f"the legend covers {artist}"
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)


def test_plot_breakdown(tmp_path):
    rows = ROWS
    path = tmp_path / "sub" / "breakdown.png"
    plot_breakdown(rows, path, "tiny U-Net, one step")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["breakdown.png"]  # no temp file left behind
