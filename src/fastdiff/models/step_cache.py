"""Step caching (DeepCache: Ma, Fang and Wang 2023, "DeepCache: Accelerating Diffusion Models for Free"): the
plain-PyTorch reference of a U-Net's full and shallow forwards.

With a cache interval N, sampling step k (0-based within the run) is a *full* forward when ``k % N == 0`` and a
*shallow* one otherwise (``fastdiff.samplers.loop.is_full_step``). A full forward runs the whole U-Net and keeps
its *deep feature*: the input of the last (shallowest, full-resolution) decoder level, i.e. the output of the
level before it, upsampler included. A shallow forward recomputes only what the shallowest skip branch needs: the
time embedding, the input conv, the first encoder level's blocks (the skips the last decoder level reads; not its
downsampler), then the last decoder level on (cached deep feature, fresh skips) and the output head.

This is the skip branch at the end of the first encoder level: in DeepCache's reference code, the Stable Diffusion
pipeline's ``cache_layer_id=0, cache_block_id=layers_per_block - 1`` (its default block 0 cuts finer, inside the
first level) and the DDPM experiments' ``branch=layers_per_block - 1``. Per family:

* ``DDPMUNet`` (diffusers' UNet2DModel) and ``UNet2DConditionModel``: deep = ``up_blocks[-2]``'s output (after
  its Upsample2D); shallow = ``embed`` (centring, time embedding), ``conv_in``, ``down_blocks[0]``'s resnets and
  attentions / transformers, ``up_blocks[-1]`` on the deep feature and the skips [conv_in, down_blocks[0]...],
  ``conv_norm_out`` + SiLU + ``conv_out``.
* ``ConvNeXtUNet``: deep = ``ups[-2]``'s output (after its upsample conv); shallow = ``embed``, ``init_conv``,
  ``downs[0]``'s two blocks (the skip), ``ups[-1]`` (its attention gate driven by the deep feature, two blocks),
  ``final_block``, ``final_conv``.

Each family's forward is built from these parts (``shallow_in``, ``deep_path``, ``shallow_out``), so the cache
calls them rather than restating it.

The engine marks the same value in each family's lowering (``fastdiff.engine.ir.GraphBuilder.cache``) and runs the
ops the output needs given it (``fastdiff.engine.executor.FusedModel.shallow_ops``).
"""

from __future__ import annotations

from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.convnext_unet import ConvNeXtUNet
from fastdiff.models.ddpm_unet import DDPMUNet
from fastdiff.models.unet_2d_condition import UNet2DConditionModel
from fastdiff.samplers.loop import check_cache_interval

MODEL_CLASSES: tuple[type[nn.Module], ...] = (DDPMUNet, UNet2DConditionModel, ConvNeXtUNet)
"""The families with a step cache (every U-Net; not the VAE)."""


def supports(model: nn.Module) -> bool:
    """Whether ``model`` has a step cache."""
    return isinstance(model, MODEL_CLASSES)


def check(model: nn.Module, cache_interval: object) -> int:
    """``cache_interval`` checked (an int >= 1) and, above 1, that ``model`` has a step cache; returns it."""
    cache_interval = check_cache_interval(cache_interval)
    if cache_interval > 1:
        check_supported(model)
    return cache_interval


def check_supported(model: nn.Module) -> None:
    """A one-line error for a model without a step cache."""
    if not supports(model):
        names = ", ".join(cls.__name__ for cls in MODEL_CLASSES)
        raise FastdiffError(f"step caching (cache_interval > 1) supports {names}; got {type(model).__name__}")


def cached_forward(
    model: nn.Module, x: Tensor, t: Tensor | int | float, deep: Tensor | None = None, context: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(model output, deep feature)`` for samples ``x`` at timesteps ``t`` (text states ``context`` for a
    ``UNet2DConditionModel``): a full forward when ``deep`` is None (its output equals ``model(x, t)``), else a
    shallow one that reuses ``deep`` (returned as is) from an earlier full forward."""
    check_supported(model)
    if isinstance(model, UNet2DConditionModel):
        if context is None:
            raise FastdiffError("a UNet2DConditionModel needs text states (context)")
        x, temb = model.embed(x, t, context)
        cond = (temb, context)  # what every block reads besides its input (and the skips)
    else:
        x, temb = model.embed(x, t)
        cond = (temb,)
    skips = model.shallow_in(x, *cond)
    if deep is None:
        deep = model.deep_path(skips, *cond)
    return model.shallow_out(deep, skips, *cond), deep
