"""ConvNeXt U-Net with attention-gated skips (annotated-diffusion ConvNeXt blocks + Attention-U-Net gates).

Layout, for ``L = len(dim_mults)`` levels with ``ch[i] = base_dim * dim_mults[i]``:

* time: sinusoidal(base_dim) -> Linear(base_dim, 4 base_dim) -> GELU -> Linear(4 base_dim, 4 base_dim).
* init: 7x7 conv (padding 3) from ``in_channels`` to ``base_dim``.
* encoder level i: two ConvNeXt blocks to ``ch[i]``, the skip is taken, then (except the last level) a
  4x4 stride-2 padding-1 conv halves the resolution.
* middle: ConvNeXt block, multi-head self-attention (optional), ConvNeXt block.
* decoder level i (from L-1 to 0): the skip passes an attention gate driven by the decoder path at the same
  resolution, is concatenated after the decoder path, two ConvNeXt blocks to ``ch[i]``, then (except level 0)
  nearest x2 upsampling + 3x3 conv to ``ch[i-1]``.
* out: ConvNeXt block ``ch[0] -> base_dim`` and a 1x1 conv to ``out_channels``.

Inputs must have ``in_channels`` channels and sides divisible by ``2 ** (L - 1)``. The prediction type
(epsilon / v) is not part of the model: it lives in the scheduler config saved next to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdiff.atomic import write_all_atomic
from fastdiff.errors import FastdiffError
from fastdiff.models.weights import WEIGHT_NAMES, find_weights, load_state_dict_checked, read_state_dict

log = logging.getLogger(__name__)

CLASS_NAME = "ConvNeXtUNet"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class ConvNeXtUNetConfig:
    """Architecture of a ConvNeXtUNet (see the module docstring)."""

    sample_size: int = 32
    in_channels: int = 3
    out_channels: int = 3
    base_dim: int = 64
    dim_mults: tuple[int, ...] = (1, 2, 4)
    convnext_mult: int = 2
    attention: bool = True
    attention_heads: int = 4
    attention_head_dim: int = 32
    gate_reduction: int = 2

    def __post_init__(self) -> None:
        self.dim_mults = tuple(self.dim_mults)
        if not self.dim_mults:
            raise FastdiffError("dim_mults must name at least one level")
        for name in ("sample_size", "in_channels", "out_channels", "base_dim", "convnext_mult",
                     "attention_heads", "attention_head_dim", "gate_reduction", "dim_mults"):  # fmt: skip
            values = getattr(self, name) if name == "dim_mults" else (getattr(self, name),)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
                raise FastdiffError(f"ConvNeXtUNet config {name} must be positive integers, got {getattr(self, name)}")
        if not isinstance(self.attention, bool):
            raise FastdiffError(f"ConvNeXtUNet config attention must be true or false, got {self.attention!r}")
        if self.sample_size % 2 ** (len(self.dim_mults) - 1):
            raise FastdiffError(
                f"sample_size {self.sample_size} is not divisible by 2**{len(self.dim_mults) - 1} "
                f"({len(self.dim_mults)} levels)"
            )


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding [B, dim] (fp32): sin, cos of t * 10000^(-k/half); odd dims end in a zero."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / max(half, 1))
    args = t.float()[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    return F.pad(emb, (0, dim % 2))


class ConvNeXtBlock(nn.Module):
    """depthwise 7x7 + time -> GN(1) -> 3x3 conv -> GELU -> GN(1) -> 3x3 conv, plus a (1x1) residual."""

    def __init__(self, dim_in: int, dim_out: int, time_dim: int, mult: int) -> None:
        super().__init__()
        hidden = dim_out * mult
        self.depthwise = nn.Conv2d(dim_in, dim_in, 7, padding=3, groups=dim_in)
        self.time_proj = nn.Linear(time_dim, dim_in)
        self.norm1 = nn.GroupNorm(1, dim_in)
        self.conv1 = nn.Conv2d(dim_in, hidden, 3, padding=1)
        self.norm2 = nn.GroupNorm(1, hidden)
        self.conv2 = nn.Conv2d(hidden, dim_out, 3, padding=1)
        self.res_conv = nn.Conv2d(dim_in, dim_out, 1) if dim_in != dim_out else nn.Identity()

    def forward(self, x: Tensor, time_emb: Tensor) -> Tensor:
        h = self.depthwise(x) + self.time_proj(F.gelu(time_emb))[:, :, None, None]
        h = self.conv1(self.norm1(h))
        h = self.conv2(self.norm2(F.gelu(h)))
        return h + self.res_conv(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention over all pixels with a GroupNorm(1) pre-norm and a residual."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, 3 * heads * head_dim, 1, bias=False)
        self.to_out = nn.Conv2d(heads * head_dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 3, self.heads, self.head_dim, h * w).transpose(-1, -2)
        out = F.scaled_dot_product_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2])  # [B, heads, HW, head_dim]
        out = out.transpose(-1, -2).reshape(b, self.heads * self.head_dim, h, w)
        return x + self.to_out(out)


class AttentionGate(nn.Module):
    """skip * sigmoid(psi(ReLU(gate_conv(g) + residual_conv(skip)))); 1x1 convs, g at the skip size."""

    def __init__(self, skip_dim: int, gate_dim: int, inter_dim: int) -> None:
        super().__init__()
        self.gate_conv = nn.Conv2d(gate_dim, inter_dim, 1)
        self.residual_conv = nn.Conv2d(skip_dim, inter_dim, 1)
        self.psi = nn.Conv2d(inter_dim, 1, 1)

    def forward(self, skip: Tensor, g: Tensor) -> Tensor:
        a = F.relu(self.gate_conv(g) + self.residual_conv(skip))
        return skip * torch.sigmoid(self.psi(a))


class ConvNeXtUNet(nn.Module):
    """``forward(x [B, C, H, W], t [B] or scalar) -> [B, out_channels, H, W]`` (see the module docstring)."""

    def __init__(self, config: ConvNeXtUNetConfig) -> None:
        super().__init__()
        self.config = config
        c, dim = config, config.base_dim
        time_dim = 4 * dim
        block = lambda i, o: ConvNeXtBlock(i, o, time_dim, c.convnext_mult)  # noqa: E731
        chans = [dim * m for m in c.dim_mults]
        self.time_mlp = nn.Sequential(nn.Linear(dim, time_dim), nn.GELU(), nn.Linear(time_dim, time_dim))
        self.init_conv = nn.Conv2d(c.in_channels, dim, 7, padding=3)
        self.downs = nn.ModuleList()
        prev = dim
        for i, ch in enumerate(chans):
            level = nn.ModuleDict({"block1": block(prev, ch), "block2": block(ch, ch)})
            if i < len(chans) - 1:
                level["downsample"] = nn.Conv2d(ch, ch, 4, stride=2, padding=1)
            self.downs.append(level)
            prev = ch
        self.mid_block1 = block(prev, prev)
        self.mid_attn = SelfAttention(prev, c.attention_heads, c.attention_head_dim) if c.attention else None
        self.mid_block2 = block(prev, prev)
        self.ups = nn.ModuleList()  # ups[k] serves encoder level L-1-k
        for i in reversed(range(len(chans))):
            ch = chans[i]
            level = nn.ModuleDict({
                "gate": AttentionGate(ch, prev, max(1, ch // c.gate_reduction)),
                "block1": block(prev + ch, ch),
                "block2": block(ch, ch),
            })  # fmt: skip
            if i > 0:
                level["upsample"] = nn.Conv2d(ch, chans[i - 1], 3, padding=1)
            self.ups.append(level)
            prev = chans[i - 1] if i > 0 else ch
        self.final_block = block(prev, dim)
        self.final_conv = nn.Conv2d(dim, c.out_channels, 1)

    def forward(self, x: Tensor, t: Tensor | float | int) -> Tensor:
        x, temb = self.embed(x, t)
        skip = self.shallow_in(x, temb)
        return self.shallow_out(self.deep_path(skip, temb), skip, temb)

    # The forward in three parts, cut where step caching (``fastdiff.models.step_cache``) cuts it: a shallow step
    # runs ``shallow_in`` and ``shallow_out`` on the deep feature (``deep_path``'s output) of an earlier full step.

    def shallow_in(self, x: Tensor, temb: Tensor) -> Tensor:
        """``init_conv`` and the first encoder level's two blocks: the skip the last decoder level reads."""
        first = self.downs[0]
        return first["block2"](first["block1"](self.init_conv(x), temb), temb)

    def deep_path(self, skip: Tensor, temb: Tensor) -> Tensor:
        """From the first level's ``skip`` to the input of the last decoder level (the step cache's deep feature):
        the first level's downsample, the deeper encoder levels, the middle, every decoder level but the last."""
        skips = [skip]
        h = self.downs[0]["downsample"](skip) if "downsample" in self.downs[0] else skip
        for level in self.downs[1:]:
            h = level["block2"](level["block1"](h, temb), temb)
            skips.append(h)
            if "downsample" in level:
                h = level["downsample"](h)
        h = self.mid_block1(h, temb)
        if self.mid_attn is not None:
            h = self.mid_attn(h)
        h = self.mid_block2(h, temb)
        for level in self.ups[:-1]:
            h = self.up_level(level, h, skips.pop(), temb)
        return h

    def shallow_out(self, deep: Tensor, skip: Tensor, temb: Tensor) -> Tensor:
        """The last decoder level on (``deep``, the first level's ``skip``), ``final_block`` and ``final_conv``."""
        h = self.up_level(self.ups[-1], deep, skip, temb)
        return self.final_conv(self.final_block(h, temb))

    def embed(self, x: Tensor, t: Tensor | float | int) -> tuple[Tensor, Tensor]:
        """The checked input and the time embedding [B, 4 base_dim] every block reads (see ``forward``)."""
        c = self.config
        factor = 2 ** (len(c.dim_mults) - 1)
        if x.dim() != 4 or x.shape[1] != c.in_channels or x.shape[2] % factor or x.shape[3] % factor:
            raise FastdiffError(
                f"ConvNeXtUNet expects [B, {c.in_channels}, H, W] with H, W divisible by {factor}, got {tuple(x.shape)}"
            )
        batch = x.shape[0]
        t = torch.as_tensor(t, device=x.device)
        if t.dim() == 0 or tuple(t.shape) == (1,):
            t = t.reshape(1).expand(batch)
        elif tuple(t.shape) != (batch,):
            raise FastdiffError(f"timesteps must be a scalar or shape ({batch},), got {tuple(t.shape)}")
        return x, self.time_mlp(timestep_embedding(t, c.base_dim).to(x.dtype))

    @staticmethod
    def up_level(level: nn.ModuleDict, h: Tensor, skip: Tensor, temb: Tensor) -> Tensor:
        """One decoder level: the gated ``skip`` after ``h``, two ConvNeXt blocks, then the upsample (if any)."""
        skip = level["gate"](skip, h)
        h = level["block2"](level["block1"](torch.cat([h, skip], dim=1), temb), temb)
        if "upsample" in level:
            h = level["upsample"](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return h


CONVNEXT_PRESETS: dict[str, ConvNeXtUNetConfig] = {
    "fashion-mnist": ConvNeXtUNetConfig(sample_size=32, in_channels=1, out_channels=1, base_dim=32,
                                        dim_mults=(1, 2, 4), attention_heads=4, attention_head_dim=32),
    "convnext-cifar10": ConvNeXtUNetConfig(sample_size=32, in_channels=3, out_channels=3, base_dim=64,
                                           dim_mults=(1, 2, 4), attention_heads=4, attention_head_dim=32),
    "convnext-64": ConvNeXtUNetConfig(sample_size=64, in_channels=3, out_channels=3, base_dim=64,
                                      dim_mults=(1, 2, 4, 4), attention_heads=4, attention_head_dim=32),
}  # fmt: skip
"""Preset name -> architecture (random weights unless a trained directory is loaded)."""


def config_from_dict(data: dict, source: str = "config") -> ConvNeXtUNetConfig:
    """A ConvNeXtUNetConfig from config.json contents; keys starting with '_' are metadata and skipped."""
    fields = {f.name for f in dataclasses.fields(ConvNeXtUNetConfig)}
    unknown = sorted(k for k in data if not k.startswith("_") and k not in fields)
    if unknown:
        raise FastdiffError(f"{source}: unknown ConvNeXtUNet config key {unknown[0]!r}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
    return ConvNeXtUNetConfig(**values)


def convnext_unet_from_dir(root: Path, config: dict) -> nn.Module:
    """A ConvNeXtUNet (fp32, CPU) from the parsed ``root/config.json`` and the weight file in ``root``."""
    model = ConvNeXtUNet(config_from_dict(config, str(root / "config.json")))
    weights = find_weights(root)
    load_state_dict_checked(model, read_state_dict(weights), str(weights))
    return model


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_convnext_unet(
    model: ConvNeXtUNet,
    directory: Path,
    scheduler_config: dict | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write config.json (with ``_class_name``), model.safetensors (floats cast to ``dtype`` if given) and
    scheduler_config.json if given, all or nothing (``fastdiff.atomic.write_all_atomic``); config.json last."""
    from safetensors.torch import save_file

    if not isinstance(model, ConvNeXtUNet):
        raise FastdiffError(f"save_convnext_unet needs a ConvNeXtUNet, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    config = {"_class_name": CLASS_NAME, **dataclasses.asdict(model.config)}
    config["dim_mults"] = list(config["dim_mults"])
    outputs = {WEIGHTS_FILE: lambda p: save_file(state, str(p), metadata={"format": "pt"})}
    if scheduler_config is not None:
        outputs["scheduler_config.json"] = lambda p: _write_json(p, scheduler_config)
    outputs["config.json"] = lambda p: _write_json(p, config)
    for stale in WEIGHT_NAMES:
        if stale != WEIGHTS_FILE and (directory / stale).is_file():
            log.warning("removing stale %s from %s (it would shadow %s)", stale, directory, WEIGHTS_FILE)
            (directory / stale).unlink()
    write_all_atomic({directory / name: write for name, write in outputs.items()})
    log.info("saved ConvNeXtUNet (%s) to %s", dtype or "native dtype", directory)
