"""CLIP's text tower, the text encoder of Stable Diffusion (transformers' ``CLIPTextModel``), as a plain module.

The same maths as transformers' class (``tests/models/test_clip_text.py`` holds it to it on SD 1.5's and SD 2.1's
configs), read from and written to the same files, without importing transformers' modelling code: that import
costs more than the rest of a pipeline's load together (``docs/engine/kernel-plans.md``, "Loading Stable
Diffusion"). The tokenizer is ``fastdiff.models.clip_tokenizer``.

One pre-LayerNorm transformer over the token and position embeddings, with a causal mask; each layer is::

    h = h + out_proj(attention(q_proj(LN1 h), k_proj(LN1 h), v_proj(LN1 h), causal))
    h = h + fc2(act(fc1(LN2 h)))          act: quick_gelu x·sigmoid(1.702x) (OpenAI CLIP) or gelu (OpenCLIP)

and the output is ``final_layer_norm(h)``: the ``last_hidden_state`` that Stable Diffusion's U-Net attends to.

Parameter names are transformers 5's (``embeddings.token_embedding.weight``, ``encoder.layers.0.self_attn.q_proj
.weight``, ``final_layer_norm.weight``); files of transformers 4 and the Hugging Face hub (the same names under
``text_model.``, often with a ``position_ids`` buffer) load too, and ``save_clip_text`` writes that older form,
which both versions read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.weights import config_from_dict, load_state_dict_checked, read_json_object, read_state_dict

ALLOWED_VALUES: dict[str, tuple] = {
    "architectures": (["CLIPTextModel"],),
    "model_type": ("clip_text_model",),
    "attention_dropout": (0.0, 0),
    "dropout": (0.0, 0),
}
"""config.json keys that are not fields: the only values this module can run."""
IGNORED_KEYS = frozenset({"initializer_range", "torch_dtype", "dtype", "transformers_version"})
"""config.json keys that change nothing at inference (init scale, the dtype the file was saved in, its writer)."""
ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
}
"""``hidden_act`` -> the MLP's activation (transformers' ``ACT2FN`` entries of the same names)."""
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""A text encoder's weights: one file, or an index (``weight_map``: name -> shard file) of several."""
HUB_PREFIX = "text_model."
"""The parameter-name prefix of transformers 4 files (those on the Hugging Face hub)."""


@dataclass(frozen=True)
class CLIPTextConfig:
    """transformers' ``CLIPTextConfig`` keys that shape the model; defaults are transformers' own."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int = 512
    """Unused by the text tower (the CLIP model's projection); kept so that a written config.json says it."""
    initializer_factor: float = 1.0
    use_attention_mask: bool = False
    """diffusers' switch (not a transformers default): pass the tokenizer's padding mask to the encoder."""
    bos_token_id: int = 49406
    eos_token_id: int = 49407
    pad_token_id: int = 1

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise FastdiffError(f"unsupported hidden_act={self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise FastdiffError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )

    @classmethod
    def from_dict(cls, config: dict, source: str = "config") -> CLIPTextConfig:
        """Config from a transformers ``config.json`` dict; values this module cannot run raise one line."""
        return config_from_dict(cls, config, source, allowed=ALLOWED_VALUES, ignored=IGNORED_KEYS)

    def to_dict(self) -> dict:
        """transformers' ``config.json`` of a ``CLIPTextModel`` with this architecture."""
        return {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", **asdict(self)}


class CLIPTextOutput(NamedTuple):
    """What ``CLIPTextModel`` returns; ``output[0]`` is the last hidden state, as with transformers' outputs."""

    last_hidden_state: Tensor


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weights ``CLIPTextModel.init_weights`` draws (or a file fills): torch's own draw on the
    meta device imports torch._dynamo, most of a second of the load."""

    def reset_parameters(self) -> None:
        pass


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.token_embedding = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class CLIPAttention(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        dim = cfg.hidden_size
        self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, h: Tensor, mask: Tensor | None) -> Tensor:
        b, n, dim = h.shape

        def heads(x: Tensor) -> Tensor:
            return x.view(b, n, self.heads, dim // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, dim))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(h)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: Tensor, mask: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.layer_norm1(h), mask)
        return h + self.mlp(self.layer_norm2(h))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class CLIPTextModel(nn.Module):
    """transformers' ``CLIPTextModel`` (its ``last_hidden_state``), parameters named as in its files."""

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.final_layer_norm.weight.dtype

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' initialisation of a new ``CLIPTextModel`` (normal weights scaled by width and depth, zero
        biases, unit LayerNorms), drawn from torch's global generator."""
        cfg, factor = self.config, self.config.initializer_factor
        depth_scale = (2 * cfg.num_hidden_layers) ** -0.5
        width_scale = cfg.hidden_size**-0.5
        for embedding in (self.embeddings.token_embedding, self.embeddings.position_embedding):
            embedding.weight.normal_(0.0, 0.02 * factor)
        for layer in self.encoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stds = {
                attn.q_proj: width_scale * depth_scale, attn.k_proj: width_scale * depth_scale,
                attn.v_proj: width_scale * depth_scale, attn.out_proj: width_scale,
                mlp.fc1: (2 * cfg.hidden_size) ** -0.5, mlp.fc2: width_scale * depth_scale,
            }  # fmt: skip
            for linear, std in stds.items():
                linear.weight.normal_(0.0, std * factor)
                linear.bias.zero_()
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> CLIPTextOutput:
        """``input_ids`` [B, L] (L at most ``max_position_embeddings``) -> last hidden state [B, L, hidden_size].

        ``attention_mask`` [B, L] (1 = token, 0 = padding) hides padding keys besides the causal mask, as in
        transformers; Stable Diffusion passes none (its pipelines pad to 77 tokens and attend to the padding)."""
        length = input_ids.shape[-1]
        if length > self.config.max_position_embeddings:
            raise FastdiffError(
                f"{length} tokens is more than the text encoder's {self.config.max_position_embeddings} positions"
            )
        h = self.embeddings(input_ids)
        mask = None
        if attention_mask is not None:
            causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
            mask = causal & attention_mask.to(device=h.device, dtype=torch.bool)[:, None, None, :]
        for layer in self.encoder.layers:
            h = layer(h, mask)
        return CLIPTextOutput(self.final_layer_norm(h))


def read_clip_state(folder: Path) -> dict[str, Tensor]:
    """The tensors of a text encoder folder (one weight file or an index of shards), named as ``CLIPTextModel``'s
    parameters: a ``text_model.`` prefix is dropped, and so is the ``position_ids`` buffer older files hold."""
    state: dict[str, Tensor] = {}
    single = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    indexes = [folder / name for name in INDEX_FILES if (folder / name).is_file()]
    if single:
        state = read_state_dict(single[0])
    elif indexes:
        weight_map = read_json_object(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FastdiffError(f"{indexes[0]}: no weight_map")
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise FastdiffError(f"{indexes[0]} names {shard}, which is missing")
            state.update(read_state_dict(folder / shard))
    else:
        raise FastdiffError(f"no weights in {folder}: expected one of {', '.join(WEIGHT_FILES + INDEX_FILES)}")
    named = {key.removeprefix(HUB_PREFIX): value for key, value in state.items()}
    named.pop("embeddings.position_ids", None)
    return named


def clip_text_from_dir(folder: Path) -> CLIPTextModel:
    """A ``CLIPTextModel`` from a transformers text-encoder folder (config.json + weights), in the file's dtype;
    every missing or mismatched piece is a one-line FastdiffError."""
    config_file = folder / "config.json"
    cfg = CLIPTextConfig.from_dict(read_json_object(config_file), source=str(config_file))
    state = read_clip_state(folder)
    with torch.device("meta"):
        model = CLIPTextModel(cfg)
    load_state_dict_checked(model, state, str(folder), assign=True)
    return model.eval()


def save_clip_text(model: CLIPTextModel, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` as transformers does (config.json + model.safetensors, names under ``text_model.``), in
    ``dtype`` (default: the model's); transformers 4 and 5 and so diffusers' pipelines load it."""
    from safetensors.torch import save

    dtype = dtype or model.dtype
    folder.mkdir(parents=True, exist_ok=True)
    state = {HUB_PREFIX + k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    (folder / "model.safetensors").write_bytes(save(state, metadata={"format": "pt"}))  # the umask's mode
    config = {**model.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def to_transformers(model: CLIPTextModel) -> nn.Module:
    """transformers' ``CLIPTextModel`` holding a copy of ``model``'s weights, for diffusers' pipelines (the test
    oracle and the bench's reference systems): imports transformers."""
    import transformers

    keys = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "model_type")}
    reference = transformers.CLIPTextModel(transformers.CLIPTextConfig(**keys))
    prefix = HUB_PREFIX if any(k.startswith(HUB_PREFIX) for k in reference.state_dict()) else ""  # transformers 4
    state = {prefix + k: v for k, v in model.state_dict().items()}
    reference.load_state_dict(state, strict=True)
    return reference.to(model.dtype).eval()
