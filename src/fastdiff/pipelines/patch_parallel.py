"""One image's latent split over processes by rows (DistriFusion's displaced patch parallelism, Li et al. 2024).

Each of ``world`` processes runs the whole U-Net on one horizontal band of the latent (rank r: rows
``[r * H / world, (r + 1) * H / world)`` at every level), and the layers that read beyond their band take the other
bands from the other processes:

1. **Convolutions** wider than 1x1 read the rows around their band (a 3x3 conv: one above and one below; the
   stride-2 downsampler: one above). Every rank sends only those edge rows of its band; the conv runs on the band
   with its neighbours' edges around it (zeros outside the image, as its padding gives).
2. **GroupNorm** needs each group's mean and variance over the whole image: every rank's band statistics (count,
   mean, sum of squared deviations) are gathered and merged with Chan et al.'s parallel formula.
3. **Self-attention** needs every token's key and value: they are gathered, the band's queries attend to all.

Everything else (1x1 convs, token-wise layers, cross-attention to the text, the time embedding) is local. The U-Net's
output bands are gathered every step, so every rank holds the whole model output and takes the same sampler step on
the whole latent: their states, and so their images, are the same bytes.

**Stale activations.** In the first ``warmup`` steps every exchange waits for the other ranks (synchronous: the
result is one process's up to the order of the GroupNorm sums). After that, a rank uses the *previous step's*
activations of the other bands (fresh ones for its own) and starts gathering this step's in the background, so the
exchange overlaps the compute; successive diffusion steps' activations are close, which is DistriFusion's premise.
The result then differs from one process's; ``tests/test_patch_parallel.py`` measures by how much.

It runs on the eager backend, as guidance-parallel does (``fastdiff.pipelines.guidance_parallel``): the engine's
fused loop is not split. The latent height must be a multiple of ``world`` times 2 per downsampler, so that every
band has whole rows at every level.

    torchrun --nproc-per-node 2 -m fastdiff.cli sample --model DIR --prompt "a cat" --patch-parallel --out cat.png
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.models.unet_2d_condition import Attention, UNet2DConditionConfig, UNet2DConditionModel

DEFAULT_WARMUP = 4
"""Synchronous steps before the exchanges go stale (DistriFusion's warm-up)."""


def check_launch() -> int:
    """The world size of a ``torchrun`` launch with at least two processes (from ``WORLD_SIZE``, checked before any
    loading); a one-line error otherwise."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        raise FastdiffError("patch-parallel runs several processes: launch it with torchrun --nproc-per-node N")
    if not world.isdigit() or int(world) < 2:
        raise FastdiffError(f"patch-parallel splits the latent over 2 or more processes, got {world}")
    return int(world)


def check_size_before_loading(model: str, height: int | None, world: int) -> None:
    """The height check of :meth:`PatchSplit.check_height` from the model's config files alone (a preset or a
    pipeline directory), so that a bad size is one line before anything loads. A model whose configs cannot be read
    here is left to the pipeline's own check."""
    import json

    from fastdiff.models.autoencoder_kl import AutoencoderKLConfig
    from fastdiff.models.stable_diffusion import SD_PRESETS, is_random_preset, resolve_pipeline_dir

    if is_random_preset(model):
        preset = SD_PRESETS[str(model)]
        unet, vae = preset.unet, preset.vae
    else:
        root = resolve_pipeline_dir(model)
        try:
            unet = UNet2DConditionConfig.from_dict(json.loads((root / "unet" / "config.json").read_text()))
            vae = AutoencoderKLConfig.from_dict(json.loads((root / "vae" / "config.json").read_text()))
        except (OSError, ValueError, FastdiffError):
            return
    factor = 2 ** (len(vae.block_out_channels) - 1)
    sample = unet.sample_size if isinstance(unet.sample_size, int) else unet.sample_size[0]
    latent = (height if height is not None else sample * factor) // factor
    size_error(unet, latent, world)


def size_error(config: UNet2DConditionConfig, height: int, world: int) -> None:
    """A one-line error unless a latent ``height`` rows high splits into ``world`` bands of whole rows at every
    level, and the downsamplers pad the image, not each band."""
    if config.downsample_padding != 1:  # padding 0 pads each band's bottom, not the image's
        raise FastdiffError("patch-parallel needs downsample_padding 1 (Stable Diffusion's)")
    halvings = len(config.block_out_channels) - 1
    step = world * 2**halvings
    if height % step:
        raise FastdiffError(
            f"patch-parallel on {world} processes needs a latent height that is a multiple of {step} "
            f"({world} bands, halved at each of {halvings} downsamplers); got {height}"
        )


class Exchange:
    """The collectives of one patch-parallel call: ``gather(key, local, dim)`` returns the whole tensor along ``dim``
    (ranks in order), with this rank's part fresh and the others' fresh (``sync`` or ``fresh``) or from the previous
    step."""

    def __init__(self, group: Any, warmup: int) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise FastdiffError(
                "patch-parallel needs torch.distributed initialised (torchrun --nproc-per-node N, then "
                "torch.distributed.init_process_group)"
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise FastdiffError(f"patch-parallel warm-up must be a positive number of steps, got {warmup!r}")
        self.dist, self.group, self.warmup = dist, group, warmup
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world < 2:
            raise FastdiffError(f"patch-parallel splits the latent over 2 or more processes, got {self.world}")
        self.step = 0
        self._parts: dict[str, list[torch.Tensor]] = {}  # by layer: the parts gathered last
        self._pending: dict[str, tuple[Any, list[torch.Tensor]]] = {}  # by layer: a gather in flight and its parts

    @property
    def sync(self) -> bool:
        return self.step < self.warmup

    def gather(self, key: str, local: torch.Tensor, dim: int, fresh: bool = False) -> torch.Tensor:
        """Every rank's ``local`` (see :meth:`parts`), concatenated along ``dim`` in rank order."""
        return torch.cat(self.parts(key, local, fresh), dim=dim)

    def parts(self, key: str, local: torch.Tensor, fresh: bool = False) -> list[torch.Tensor]:
        """Every rank's ``local`` of layer ``key``, in rank order: this rank's as given, the others' of this call
        (``sync`` or ``fresh``: the collective runs now) or of the previous one (this call's gather then runs in the
        background, waited for at the layer's next call)."""
        local = local.contiguous()
        if key in self._pending:
            work, parts = self._pending.pop(key)
            work.wait()
            self._parts[key] = parts
        if self.sync or fresh or key not in self._parts:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            self.dist.all_gather(parts, local, group=self.group)
            self._parts[key] = parts
            return parts
        parts = list(self._parts[key])
        parts[self.rank] = local
        incoming = [torch.empty_like(local) for _ in range(self.world)]
        self._pending[key] = (self.dist.all_gather(incoming, local, group=self.group, async_op=True), incoming)
        return parts

    def finish(self) -> None:
        """Wait for the gathers still in flight (the last step's, which nothing reads)."""
        for work, _ in self._pending.values():
            work.wait()
        self._pending.clear()
        self._parts.clear()


class BandConv2d(nn.Module):
    """A conv wider than 1x1 on this rank's band: its input gathered, the conv run on the band's window of it."""

    def __init__(self, conv: nn.Conv2d, exchange: Exchange, key: str) -> None:
        super().__init__()
        if conv.padding_mode != "zeros" or conv.dilation != (1, 1) or conv.groups != 1 or isinstance(conv.padding, str):
            raise FastdiffError(f"patch-parallel: {key} is not a plain zero-padded conv")
        (k, _), (stride, _), (p, _) = conv.kernel_size, conv.stride, conv.padding
        if not k - stride <= 2 * p <= k - 1:  # a band of h rows must give h / stride output rows (h a multiple)
            raise FastdiffError(f"patch-parallel: {key} (kernel {k}, stride {stride}, padding {p}) changes the size")
        self.conv, self.exchange, self.key = conv, exchange, key

    def reach(self) -> tuple[int, int]:
        """Rows of the band above and of the band below that this band's output reads: a band's output rows read
        the input rows [top - p, top + h + k - s - p), so p above and k - s - p below (negative: fewer of its own)."""
        (k, _), (s, _), (p, _) = self.conv.kernel_size, self.conv.stride, self.conv.padding
        return p, k - s - p

    def edges(self, x: torch.Tensor) -> torch.Tensor:
        """What this band sends: its first rows (the band above reads them) and its last (the band below reads)."""
        above, below = self.reach()
        return torch.cat([x[:, :, : max(below, 0)], x[:, :, x.shape[2] - above :]], dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (_, _), (s, _), (_, pw) = self.conv.kernel_size, self.conv.stride, self.conv.padding
        h, rank, world = x.shape[2], self.exchange.rank, self.exchange.world
        if h % s:
            raise FastdiffError(f"patch-parallel: {self.key}'s band of {h} rows does not fit its stride {s}")
        above, below = self.reach()
        if h < max(above, below):
            raise FastdiffError(f"patch-parallel: {self.key} reads {max(above, below)} rows beyond a band of {h} rows")
        parts = self.exchange.parts(self.key, self.edges(x))
        zeros = x.new_zeros(x.shape[0], x.shape[1], 0, x.shape[3])
        top_rows = parts[rank - 1][:, :, max(below, 0) :] if rank > 0 else F.pad(zeros, (0, 0, 0, above))
        bottom_rows = (
            (parts[rank + 1][:, :, :below] if rank < world - 1 else F.pad(zeros, (0, 0, 0, below)))
            if below > 0
            else zeros
        )
        window = torch.cat([top_rows, x[:, :, : h + min(below, 0)], bottom_rows], dim=2)
        return F.conv2d(window, self.conv.weight, self.conv.bias, stride=self.conv.stride, padding=(0, pw))


class BandGroupNorm(nn.Module):
    """GroupNorm over the whole image: every band's per-group count, mean and sum of squared deviations merged
    (Chan et al.), then this band normalised with the result."""

    def __init__(self, norm: nn.GroupNorm, exchange: Exchange, key: str) -> None:
        super().__init__()
        self.norm, self.exchange, self.key = norm, exchange, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        groups = self.norm.num_groups
        values = x.reshape(b, groups, -1)
        count = values.shape[2]
        var, mean = torch.var_mean(values.float(), dim=2, correction=0)  # two-pass accuracy: no E[x^2] - E[x]^2
        m2 = var * count
        stats = self.exchange.gather(self.key, torch.stack([mean, m2])[None], dim=0)  # [world, 2, B, G]
        means, m2s = stats[:, 0], stats[:, 1]
        total_mean = means.mean(dim=0)  # every band has the same count
        total_m2 = (m2s + count * (means - total_mean).square()).sum(dim=0)
        rstd = torch.rsqrt(total_m2 / (count * stats.shape[0]) + self.norm.eps)  # [B, G]
        per = c // groups
        scale = rstd.repeat_interleave(per, dim=1)  # [B, C]
        shift = -total_mean.repeat_interleave(per, dim=1) * scale
        if self.norm.affine:
            scale = scale * self.norm.weight.float()
            shift = shift * self.norm.weight.float() + self.norm.bias.float()
        return torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None]).to(x.dtype)  # one pass over x


class BandAttention(nn.Module):
    """Self-attention of this band's tokens over every band's keys and values (gathered); cross-attention to the
    text is local."""

    def __init__(self, attention: Attention, exchange: Exchange, key: str) -> None:
        super().__init__()
        self.attention, self.exchange, self.key = attention, exchange, key

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention
        if context is not None:
            return a(x, context)
        b = x.shape[0]
        key_values = self.exchange.gather(self.key, torch.cat([a.to_k(x), a.to_v(x)], dim=2), dim=1)
        k, v = key_values.chunk(2, dim=2)
        q = a.to_q(x).view(b, -1, a.heads, a.head_dim).transpose(1, 2)
        k, v = (t.reshape(b, -1, a.heads, a.head_dim).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, a.heads * a.head_dim)
        return a.to_out[0](out)


def band_layers(unet: nn.Module, exchange: Exchange) -> dict[str, nn.Module]:
    """``{module name: its band form}`` for every layer of ``unet`` that reads beyond its band."""
    swaps: dict[str, nn.Module] = {}
    for name, module in unet.named_modules():
        if isinstance(module, nn.Conv2d) and module.kernel_size != (1, 1):
            swaps[name] = BandConv2d(module, exchange, name)
        elif isinstance(module, nn.GroupNorm):
            swaps[name] = BandGroupNorm(module, exchange, name)
        elif isinstance(module, Attention):
            swaps[name] = BandAttention(module, exchange, name)
    return swaps


@contextmanager
def swapped(unet: nn.Module, swaps: dict[str, nn.Module]) -> Iterator[None]:
    """``unet`` with the modules named in ``swaps`` replaced, restored on exit."""
    originals = {}
    try:
        for name, replacement in swaps.items():
            parent_name, _, child = name.rpartition(".")
            parent = unet.get_submodule(parent_name) if parent_name else unet
            originals[name] = (parent, child, getattr(parent, child))
            setattr(parent, child, replacement)
        yield
    finally:
        for parent, child, original in originals.values():
            setattr(parent, child, original)


class PatchSplit:
    """Rank r of ``group`` runs band r of every U-Net call of a sampling run (``run``); ``warmup`` synchronous steps
    first (see the module docstring)."""

    def __init__(self, group: Any = None, warmup: int = DEFAULT_WARMUP) -> None:
        self.group, self.warmup = group, warmup
        Exchange(group, warmup)  # the checks, before any sampling

    def check_height(self, unet: nn.Module, height: int) -> None:
        """A one-line error unless a latent ``height`` rows high splits into whole rows at every level."""
        if not isinstance(unet, UNet2DConditionModel):
            raise FastdiffError(f"patch-parallel splits a UNet2DConditionModel, got {type(unet).__name__}")
        import torch.distributed as dist

        size_error(unet.config, height, dist.get_world_size(self.group))

    @contextmanager
    def run(self, unet: nn.Module) -> Iterator[Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]]:
        """For one sampling run: yields ``wrap``, which turns ``model(inp, t)`` on the whole latent into the band
        form (this rank's rows in, every rank's output rows gathered out, one exchange step per call)."""
        exchange = Exchange(self.group, self.warmup)
        with swapped(unet, band_layers(unet, exchange)):

            def wrap(model: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
                def banded(inp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                    band = inp.shape[2] // exchange.world
                    rows = slice(exchange.rank * band, (exchange.rank + 1) * band)
                    out = exchange.gather("output", model(inp[:, :, rows], t), dim=2, fresh=True)
                    exchange.step += 1  # one model call per sampler step (samplers/loop.py): steps = calls
                    return out

                return banded

            try:
                yield wrap
            finally:
                exchange.finish()
