"""The implementations an op may run (:func:`candidates`), with the checks of which kernels fit it.

* conv: the gather conv ``kernels.conv2d`` (``triton``); on Hopper also, for stride-1 convs, the TMA conv
  ``kernels.conv2d_tma`` (``triton-tma``) and, for those of at least 64 output channels without an activation or
  upsampling, its Gluon form ``kernels.conv2d_gluon`` (``gluon``; ``gluon-p2``: persistent, two programs per SM);
  the tap-sum conv ``kernels.tap_sum_conv2d`` (``triton-taps``) for a stride-1 conv of at most 8 output channels with
  a bias-only epilogue; on CUDA the gather conv with its reduction split over 2-16 programs where its grid leaves SMs
  idle (``triton-k<N>``); each registered fusion's forms (``engine/fusion.py``: ``triton-sc[-k<N>]``,
  ``gluon[-p2]-sc``, ``triton[-sc]-gn[-k<N>]``, ``triton[-sc]-st[-k<N>]``); cuDNN + a torch epilogue (``cudnn``).
  A conv reading an e4m3 input (``fp8=True``) runs the fp8 TMA conv only, also split-K where its grid leaves SMs
  idle (``triton-tma-fp8[-k<N>]``; the fp16/bf16 TMA conv runs split too, ``triton-tma-k<N>``, when an op's
  implementation is set to it, but is not offered: on the H100 its split forms lost to the gather kernel's at batch 1
  and to its own unsplit form at batch 256's 4x4 level, docs/engine/fp8.md, "Split-K for the fp8 convs"). A token
  GEMM reading an e4m3 input runs the TMA GEMM on e4m3 operands only (``triton-tma-fp8[-t...]``).
* token GEMM: ``kernels.linear`` (on CUDA on each of its tiles, ``triton-t<BMxBNxBKxWxS>``, and on Hopper its TMA
  form on each, ``triton-tma[-t...]``) or cuBLAS + a torch epilogue; depthwise conv: ``kernels.depthwise_conv2d``
  or cuDNN.
* attention: ``kernels.attention`` (on CUDA also its keys split over 2-8 programs per query block where those leave
  SMs idle, ``triton-kv<N>``, and for at most 512 keys its whole-rows schedule, ``triton-rows``; 16-bit: each on
  its tiles, ``-t<BMxBNxWxS>``) or torch SDPA. Tiles are candidates, not timed by the kernels themselves: a kernel
  plan then pins every tile, and processes with one plan give the same bytes.
* GroupNorm: the kernel's own launch plan or, on CUDA, whole groups at 4-64 channel lanes per program
  (``triton-c<L>``).

``conv_impl`` ("auto", "triton", "cudnn") narrows the convs and GEMMs, ``attention_impl`` ("auto", "triton", "sdpa")
the attention; the first candidate is the default before (or without) the autotune.
"""

from __future__ import annotations

import dataclasses

import torch

from fastdiff.engine.fusion import BoundModel
from fastdiff.engine.impl import TRITON, Impl
from fastdiff.engine.ir import Op, tokens
from fastdiff.kernels.attention import ROWS_MAX_KEYS, attention_tiles, split_kv_choices
from fastdiff.kernels.conv2d import split_k_choices
from fastdiff.kernels.conv2d_gluon import gluon_conv_unsupported
from fastdiff.kernels.conv2d_tma import tma_conv_unsupported, tma_split_k_choices
from fastdiff.kernels.fp8 import FP8_DTYPE
from fastdiff.kernels.group_norm_act import LANE_CHOICES
from fastdiff.kernels.linear import linear_tiles, tma_linear_unsupported
from fastdiff.kernels.tap_sum_conv2d import tap_sum_unsupported

CONV_IMPLS = ("auto", "triton", "cudnn")
ATTENTION_IMPLS = ("auto", "triton", "sdpa")


NOT_REPEATABLE = (("conv", Impl("triton-tma")),)
"""(op kind, implementation) left out of the candidates because they do not give the same bytes twice: the fp16/bf16 TMA
conv (``kernels/conv2d_tma.py``), measured on the H100 (Triton 3.6) at ddpm-cifar10 batch 256: 7 of its 41 convs
(the ResNet blocks' conv1, with the time-embedding epilogue) changed their output between two identical calls
(max |diff| 0.16), so images differed between processes with one kernel plan (206 of 256); without it, 0 of 256,
at +12 % in the step's op time (docs/engine/kernel-plans.md). Its e4m3 form (``fp8=True``, opt-in) stays."""


def candidates(model: BoundModel, op: Op) -> tuple[Impl, ...]:
    """The implementations ``op`` may run: several to time, or the one forced / the only one."""
    cuda = model.device.type == "cuda"
    if op.kind == "conv" and "fp8_scale" in op.params:  # the TMA kernel, also split-K where its grid leaves SMs
        fp8 = Impl("triton-tma", fp8=True)
        return (fp8, *(Impl("triton-tma", fp8=True, split_k=split) for split in tma_split_choices(model, op)))
    if op.kind == "linear" and "fp8_scale" in op.params:  # the TMA GEMM, on each of its tiles (CUDA)
        tiles = linear_tiles(token_rows(op), tma=True)[1:] if cuda else ()
        return (Impl("triton-tma", fp8=True), *(Impl("triton-tma", fp8=True, tile=tile) for tile in tiles))
    if op.kind in ("conv", "depthwise", "linear"):
        library = Impl("cublas" if op.kind == "linear" else "cudnn")
        ours = (TRITON,)  # the fp16/bf16 TMA conv is no candidate: not repeatable on Triton 3.6 (NOT_REPEATABLE)
        if op.kind == "linear" and cuda:  # + the GEMM's other tiles, and its TMA form on each where it fits
            tiles = linear_tiles(token_rows(op))
            ours = (TRITON, *(Impl("triton", tile=tile) for tile in tiles[1:]))
            if tma_linear_fits(model, op):  # its 4-warp tiles (kernels.linear.linear_tiles)
                tma_tiles = linear_tiles(token_rows(op), tma=True)[1:]
                ours = (*ours, Impl("triton-tma"), *(Impl("triton-tma", tile=tile) for tile in tma_tiles))
        if op.kind == "conv" and taps_fit(model, op):  # + the tap-sum form of a conv with few output channels
            ours = (*ours, Impl("triton-taps"))
        if op.kind == "conv" and gluon_fits(model, op):  # + the Gluon TMA conv, one tile per program or persistent
            ours = (*ours, Impl("gluon"), Impl("gluon", programs_per_sm=2))
        if op.kind == "conv" and cuda:
            ours = (*ours, *(Impl("triton", split_k=split) for split in gather_split_choices(model, op)))
            for fusion in model.fusions:  # + the forms that run a fusion with the conv's partner (engine/fusion.py)
                partner = model.pairs[fusion.tag].get(op.name)
                if partner is not None:
                    ours = (*ours, *fusion.variants(model, op, partner, ours))
        return {"auto": (*ours, library), "triton": ours, "cudnn": (library,)}[model.conv_impl]
    if op.kind == "attention":
        ours = (TRITON,)
        if cuda:  # + the keys split over programs where the query blocks leave SMs idle
            q, kv = op.inputs[0].shape, op.inputs[-1].shape
            splits = split_kv_choices(q[0], op.params["heads"], q[2] * q[3], kv[2] * kv[3], model.device)
            ours = (*ours, *(Impl("triton", split_kv=split) for split in splits))
            if kv[2] * kv[3] <= ROWS_MAX_KEYS:  # + whole score rows, the value columns split
                ours = (*ours, Impl("triton", rows=True))
            if model.dtype in (torch.float16, torch.bfloat16):  # + each schedule's other tiles
                ours = tuple(form for impl in ours for form in with_tiles(impl, op))
        return {"auto": (*ours, Impl("sdpa")), "triton": ours, "sdpa": (Impl("sdpa"),)}[model.attention_impl]
    if op.kind == "group_norm" and cuda:  # the kernel's plan, or whole groups per width
        group = op.inputs[0].shape[1] // op.params["groups"]
        return (TRITON, *(Impl("triton", lanes=lanes) for lanes in LANE_CHOICES if lanes >= group))
    return (Impl("torch"),) if op.kind == "center" else (TRITON,)


def token_rows(op: Op) -> int:
    """Rows of a token GEMM's input matrix: a [B, K, H, W] value viewed as [B*H*W, K]."""
    n, _, h, w = op.inputs[0].shape
    return n * h * w


def with_tiles(impl: Impl, op: Op) -> tuple[Impl, ...]:
    """An attention implementation and its forms on the schedule's other tiles (``kernels.attention.attention_tiles``;
    the first, the default, is ``impl`` itself)."""
    q = op.inputs[0].shape
    tiles = attention_tiles(op.params["head_dim"], q[2] * q[3], "rows" if impl.rows else "stream")
    return (impl, *(dataclasses.replace(impl, tile=tile) for tile in tiles[1:]))


def default_why(model: BoundModel, op: Op) -> str:
    """Why ``op`` runs its first candidate when the autotune did not choose."""
    if op.kind in ("conv", "linear") and "fp8_scale" in op.params:
        return "fp8 (e4m3) input: the TMA kernel only"
    if op.kind in ("conv", "depthwise", "linear"):
        return f"conv_impl={model.conv_impl}" + (" (not timed off CUDA)" if model.conv_impl == "auto" else "")
    if op.kind == "attention":
        untimed = " (not timed off CUDA)" if model.attention_impl == "auto" else ""
        return f"attention_impl={model.attention_impl}{untimed}"
    if op.kind == "group_norm" and model.device.type != "cuda":
        return "the kernel's own plan (not timed off CUDA)"
    return "single implementation"


def gather_split_choices(model: BoundModel, op: Op) -> tuple[int, ...]:
    """The split-K factors of the gather conv worth timing for ``op`` (its grid leaves SMs idle)."""
    (n, cin, *_), (_, cout, ho, wo) = op.inputs[0].shape, op.output.shape
    return split_k_choices(n, cin, cout, (ho, wo), op.params["ksize"], model.dtype, model.device)


def tma_split_choices(model: BoundModel, op: Op) -> tuple[int, ...]:
    """The split-K factors of the fp8 TMA conv worth timing for ``op`` (:func:`tma_split_k_choices`; CUDA only).
    Not offered to the fp16/bf16 TMA conv (module docstring)."""
    if model.device.type != "cuda":
        return ()
    (n, cin, *_), (_, cout, ho, wo) = op.inputs[0].shape, op.output.shape  # fp8: never an Upsample2D
    return tma_split_k_choices(n, ho, wo, cin, cout, op.params["ksize"], FP8_DTYPE, model.device)


def taps_fit(model: BoundModel, op: Op) -> bool:
    """Whether ``op`` can run as :func:`fastdiff.kernels.tap_sum_conv2d.tap_sum_conv2d` (a stride-1 conv of at most
    ``MAX_COUT`` output channels with a bias-only epilogue, on the GPU: its gain is the GPU's re-read input)."""
    p = op.params
    if op.kind != "conv" or model.device.type != "cuda" or "pad_end" in p or p["upsample"] != 1:
        return False
    if any(p.get(key) is not None for key in ("temb", "act", "scale")) or len(op.inputs) > 1:  # + a residual
        return False
    if "fp8_scale" in p:
        return False
    probe = torch.empty(op.inputs[0].shape, device="meta")
    return tap_sum_unsupported(probe, op.output.shape[1], p["ksize"], p["stride"], p["padding"]) is None


def tma_fits(model: BoundModel, op: Op) -> bool:
    """Whether the TMA conv kernel can run ``op`` (CUDA on Hopper or newer, stride 1, Upsample2D at most)."""
    if model.device.type != "cuda" or "pad_end" in op.params:
        return False
    p, x = op.params, model.tensor(op.inputs[0])
    why = tma_conv_unsupported(
        x, op.output.shape[1], p["ksize"], stride=p["stride"], padding=p["padding"], upsample=p["upsample"]
    )
    return why is None


def tma_linear_fits(model: BoundModel, op: Op) -> bool:
    """Whether the TMA form of :func:`fastdiff.kernels.linear.linear` can run the token GEMM ``op`` (Hopper,
    16-bit, aligned rows: :func:`fastdiff.kernels.linear.tma_linear_unsupported` on its bound input and its packed
    weight's shape, ``[K, N_w]`` contiguous)."""
    if model.device.type != "cuda":
        return False
    x = model.tensor(op.inputs[0])
    n_w = op.output.shape[1] * (2 if op.params["geglu"] else 1)
    return tma_linear_unsupported(tokens(x), torch.empty((x.shape[1], n_w), device="meta")) is None


def gluon_fits(model: BoundModel, op: Op) -> bool:
    """Whether :func:`fastdiff.kernels.conv2d_gluon.conv2d_gluon` can run ``op`` (the TMA conv's domain in
    fp16/bf16, no activation or upsampling, at least 64 output channels: the shapes it was measured on)."""
    p = op.params
    if not tma_fits(model, op) or p["upsample"] != 1 or "fp8_scale" in p or op.output.shape[1] < 64:
        return False
    x, cout = model.tensor(op.inputs[0]), op.output.shape[1]
    why = gluon_conv_unsupported(x, cout, p["ksize"], stride=p["stride"], padding=p["padding"], activation=p["act"])
    return why is None
