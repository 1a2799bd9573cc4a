"""Stable Diffusion 1.x / 2.x components from a local diffusers ``StableDiffusionPipeline`` directory.

The U-Net, the VAE and the CLIP text encoder are fastdiff's own modules; the CLIP tokenizer runs on the
``tokenizers`` package (install with ``pip install 'fastdiff[sd]'``). transformers reads and writes the same files
and is the test oracle, never imported here.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.autoencoder_kl import (
    SD15_VAE_CONFIG,
    SD21_VAE_CONFIG,
    AutoencoderKL,
    AutoencoderKLConfig,
    autoencoder_kl_from_dir,
)
from fastdiff.models.clip_text import CLIPTextConfig, CLIPTextModel, clip_text_from_dir
from fastdiff.models.clip_tokenizer import CLIPTokenizer
from fastdiff.models.unet_2d_condition import (
    SD15_CONFIG,
    SD21_CONFIG,
    UNet2DConditionConfig,
    UNet2DConditionModel,
    unet_2d_condition_from_dir,
)
from fastdiff.models.weights import read_json_object

log = logging.getLogger(__name__)

PIPELINE_PARTS = ("model_index.json", "unet/", "vae/", "text_encoder/", "tokenizer/", "scheduler/")
PARTS_HINT = f"a StableDiffusionPipeline directory needs {', '.join(PIPELINE_PARTS)}"

SUPPORTED_PIPELINES = ("StableDiffusionPipeline",)
SUPPORTED_COMPONENTS: dict[str, tuple[str, ...]] = {
    "unet": ("UNet2DConditionModel",),
    "vae": ("AutoencoderKL",),
    "text_encoder": ("CLIPTextModel",),
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
}
"""model_index.json entry -> the class names fastdiff loads for it."""


SD15_TEXT_CONFIG: dict = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
}  # fmt: skip
"""runwayml/stable-diffusion-v1-5 text_encoder/config.json (OpenAI CLIP ViT-L/14's text tower), architecture keys."""
SD21_TEXT_CONFIG: dict = {
    "vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 23,
    "num_attention_heads": 16, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 512,
}  # fmt: skip
"""stabilityai/stable-diffusion-2-1 text_encoder/config.json (OpenCLIP ViT-H/14's text tower), architecture keys."""
SD15_SCHEDULER_CONFIG: dict = {
    "_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "trained_betas": None, "clip_sample": False,
}  # fmt: skip
"""runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json."""
SD21_SCHEDULER_CONFIG: dict = {
    "_class_name": "DDIMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "clip_sample": False, "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
    "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
}  # fmt: skip
"""stabilityai/stable-diffusion-2-1 scheduler/scheduler_config.json."""


@dataclass(frozen=True)
class StableDiffusionPreset:
    """Architecture of a Stable Diffusion release (random weights only: fastdiff ships no SD weights)."""

    unet: UNet2DConditionConfig
    vae: AutoencoderKLConfig
    text: dict = field(default_factory=dict)
    """``CLIPTextConfig`` keys of the text encoder (transformers' names)."""
    scheduler: dict = field(default_factory=dict)
    """The release's scheduler/scheduler_config.json."""
    pad_token: str = "<|endoftext|>"
    """The tokenizer's padding token (SD 2.x pads with "!")."""
    text_tokens: int = 77
    """CLIP's sequence length: ``encoder_hidden_states`` are [B, text_tokens, unet.cross_attention_dim]."""


SD_PRESETS: dict[str, StableDiffusionPreset] = {
    "sd15": StableDiffusionPreset(SD15_CONFIG, SD15_VAE_CONFIG, SD15_TEXT_CONFIG, SD15_SCHEDULER_CONFIG),
    "sd21": StableDiffusionPreset(SD21_CONFIG, SD21_VAE_CONFIG, SD21_TEXT_CONFIG, SD21_SCHEDULER_CONFIG, "!"),
}
"""runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2-1 (conditional U-Nets: kept apart from the
unconditional ``fastdiff.models.PRESETS`` that ``load_unet`` serves)."""


BUNDLED_PIPELINES: dict[str, Path] = {
    "fashion-mnist-t2i": Path(__file__).resolve().parent.parent / "weights" / "fashion-mnist-t2i",
}
"""Text-to-image preset name -> its bundled StableDiffusionPipeline directory (trained weights, fp16 safetensors):
fashion-mnist-t2i is ``fastdiff train text-to-image`` on Fashion-MNIST (32x32 grayscale, 10 class prompts)."""


def resolve_pipeline_dir(name_or_path: str | Path) -> Path:
    """A bundled text-to-image preset's directory (``BUNDLED_PIPELINES``), else ``name_or_path`` as a path.

    A local file or folder of the same name as a preset wins, as with ``fastdiff.models.load_unet``.
    """
    path = Path(name_or_path).expanduser()
    name = str(name_or_path)
    if name in BUNDLED_PIPELINES and not path.exists():
        return BUNDLED_PIPELINES[name]
    return path


def is_random_preset(name_or_path: str | Path) -> bool:
    """Whether ``name_or_path`` names a Stable Diffusion architecture preset (``SD_PRESETS``: random weights) and no
    local file or folder of that name exists."""
    return str(name_or_path) in SD_PRESETS and not Path(name_or_path).expanduser().exists()


@dataclass
class StableDiffusionComponents:
    """Everything a text-to-image sampler needs, on one device and dtype."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    """CLIP's text tower (``fastdiff.models.clip_text``; transformers' ``CLIPTextModel`` in the test oracles)."""
    tokenizer: CLIPTokenizer
    """CLIP's tokenizer (``fastdiff.models.clip_tokenizer``, on the tokenizers package)."""
    scheduler_config: dict
    """scheduler/scheduler_config.json as written by diffusers (``_class_name`` names the scheduler)."""
    model_index: dict


def load_stable_diffusion(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    draw_device: str | torch.device | None = None,
) -> StableDiffusionComponents:
    """Load U-Net, VAE, CLIP text encoder, tokenizer and scheduler config from a diffusers pipeline directory
    (or a bundled text-to-image preset name: ``BUNDLED_PIPELINES``; or "sd15" / "sd21": ``random_components``,
    random weights for speed measurements, when no file or folder has that name).

    Weight files may be safetensors or .bin, in any floating dtype; every model is converted to ``dtype``.
    Each missing or unusable piece raises a one-line FastdiffError naming it. A random preset's weights are drawn
    on ``draw_device`` (default ``device``; ``random_components``), then moved to ``device``.
    """
    if is_random_preset(path):
        parts = random_components(str(path), device=draw_device or device)
        parts.unet.scheduler_config = parts.scheduler_config
        for model in (parts.unet, parts.vae, parts.text_encoder):
            model.to(device=device, dtype=dtype)
        return parts
    root = resolve_pipeline_dir(path)
    if not root.exists():
        raise FastdiffError(f"Stable Diffusion path not found: {root}")
    if not root.is_dir():
        raise FastdiffError(f"Stable Diffusion path is not a directory: {root}")
    for part in PIPELINE_PARTS:
        present = (root / part).is_dir() if part.endswith("/") else (root / part).is_file()
        if not present:
            raise FastdiffError(f"{root}: missing {part} ({PARTS_HINT})")
    model_index = read_json_object(root / "model_index.json")
    check_model_index(model_index, root / "model_index.json")
    unet = unet_2d_condition_from_dir(root / "unet", read_json_object(root / "unet" / "config.json"))
    vae = autoencoder_kl_from_dir(root / "vae", read_json_object(root / "vae" / "config.json"))
    text_encoder = load_text_encoder(root / "text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(root / "tokenizer")
    scheduler_config = read_json_object(root / "scheduler" / "scheduler_config.json")
    if text_encoder.config.hidden_size != unet.config.cross_attention_dim:
        raise FastdiffError(
            f"{root}: text encoder hidden_size {text_encoder.config.hidden_size} does not match the U-Net's "
            f"cross_attention_dim {unet.config.cross_attention_dim}"
        )
    unet.scheduler_config = scheduler_config
    log.info("loaded Stable Diffusion pipeline from %s", root)
    return StableDiffusionComponents(
        unet=unet.to(device=device, dtype=dtype).eval(),
        vae=vae.to(device=device, dtype=dtype).eval(),
        text_encoder=text_encoder.to(device=device, dtype=dtype).eval(),
        tokenizer=tokenizer,
        scheduler_config=scheduler_config,
        model_index=model_index,
    )


def check_model_index(model_index: dict, source: Path) -> None:
    """An unsupported pipeline or component class raises a one-line FastdiffError."""
    pipeline = model_index.get("_class_name")
    if pipeline not in SUPPORTED_PIPELINES:
        supported = ", ".join(SUPPORTED_PIPELINES)
        raise FastdiffError(f"{source}: pipeline class {pipeline!r} is not supported ({supported})")
    for component, supported in SUPPORTED_COMPONENTS.items():
        entry = model_index.get(component)
        if not isinstance(entry, list) or len(entry) != 2:
            raise FastdiffError(f"{source}: {component!r} must be a [library, class] pair, got {entry!r}")
        if entry[1] not in supported:
            raise FastdiffError(f"{source}: {component} class {entry[1]!r} is not supported ({', '.join(supported)})")


def load_text_encoder(folder: Path) -> CLIPTextModel:
    """The CLIP text encoder in ``folder`` (transformers' config.json + weights): fastdiff's ``CLIPTextModel``,
    which reads transformers' files without importing its modelling code."""
    if not (folder / "config.json").is_file():
        raise FastdiffError(f"missing {folder / 'config.json'}")
    return clip_text_from_dir(folder)


def encode_prompts(
    text_encoder: nn.Module,
    tokenizer: Any,
    prompts: list[str],
    device: str | torch.device,
    warnings: list[str] | None = None,
    check: bool = True,
) -> Tensor:
    """Text states [len(prompts), model_max_length, hidden]: diffusers' default ``encode_prompt``.

    As ``StableDiffusionPipeline.encode_prompt`` without clip_skip: padded to the tokenizer's max length, truncated,
    the encoder's last hidden state in the encoder's dtype.

    Each problem of a prompt (``prompt_warnings``: words out of the model's vocabulary, tokens dropped by the
    truncation) is logged as one warning line and appended to ``warnings`` when given; ``check=False`` skips this
    (for callers that checked the prompts already).

    For classifier-free guidance, the unconditional states are ``encode_prompts(..., [""] * batch, ...)``.
    """
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise FastdiffError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    max_length = tokenizer.model_max_length
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    ids = tokens.input_ids
    problems = log_prompt_warnings(tokenizer, prompts) if check else []
    if warnings is not None:
        warnings.extend(problems)
    use_mask = getattr(text_encoder.config, "use_attention_mask", False)
    mask = tokens.attention_mask.to(device) if use_mask else None
    with torch.no_grad():
        states = text_encoder(ids.to(device), attention_mask=mask)[0]
    return states.to(dtype=text_encoder.dtype, device=device)


SHOWN_WORDS = 5
"""How many unknown or dropped words a prompt warning names."""

MIN_VOCABULARY_WORDS = 50
"""Whole words (two letters or more) a tokenizer must hold for its vocabulary to be checked: fewer, and it is a
byte-level stand-in (the random-weight presets, test fixtures) that spells every word in bytes."""


def log_prompt_warnings(tokenizer: Any, prompts: list[str]) -> list[str]:
    """``prompt_warnings``, each line also logged as a warning."""
    problems = prompt_warnings(tokenizer, prompts)
    for problem in problems:
        log.warning("%s", problem)
    return problems


def prompt_warnings(tokenizer: Any, prompts: list[str]) -> list[str]:
    """One line per problem of each prompt, as ``encode_prompts`` would meet it: words out of the tokenizer's
    vocabulary (``unknown_words``), tokens beyond the model's ``model_max_length`` (dropped by the truncation).
    Lines name their prompt (quoted, shortened) when ``prompts`` holds more than one non-empty prompt.

    Tokenizes without truncation and with ``verbose=False`` (a transformers tokenizer then logs no warning of its
    own).
    """
    max_length = tokenizer.model_max_length
    content = max_length - tokenizer.num_special_tokens_to_add()
    untruncated = tokenizer(prompts, add_special_tokens=False, verbose=False).input_ids
    check_vocabulary = knows_words(tokenizer)
    named = sum(1 for p in prompts if p.strip()) > 1
    lines = []
    for prompt, ids in zip(prompts, untruncated, strict=True):
        problems = []
        unknown = unknown_words(tokenizer, ids) if check_vocabulary else []
        if unknown:
            verb = "is" if len(unknown) == 1 else "are"
            problems.append(
                f"{len(unknown)} of the prompt's words {verb} not in the model's vocabulary "
                f"(first few: {', '.join(unknown[:SHOWN_WORDS])})"
            )
        if max_length and len(ids) > content:
            dropped = tokenizer.decode(ids[content:]).split()
            if content > 0 and dropped and not tokenizer.convert_ids_to_tokens(ids[content - 1]).endswith(END_OF_WORD):
                dropped[0] = "…" + dropped[0]  # the cut falls inside this word
            problems.append(
                f"the prompt is longer than the model's {max_length} tokens and is truncated: "
                f"{len(ids) - content} tokens dropped "
                f"(first few words dropped: {' '.join(dropped[:SHOWN_WORDS])})"
            )
        lines += [f"prompt {shorten(prompt)!r}: {problem}" if named else problem for problem in problems]
    return lines


def shorten(text: str, width: int = 40) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


_KNOWS_WORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""``knows_words`` per tokenizer (its vocabulary does not change; a real CLIP one copies 49k entries to scan)."""


def knows_words(tokenizer: Any) -> bool:
    """:func:`vocabulary_has_words`, remembered per tokenizer."""
    try:
        return _KNOWS_WORDS[tokenizer]
    except KeyError:
        known = _KNOWS_WORDS[tokenizer] = vocabulary_has_words(tokenizer)
        return known
    except TypeError:  # not weak-referenceable
        return vocabulary_has_words(tokenizer)


def vocabulary_has_words(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s vocabulary holds at least ``MIN_VOCABULARY_WORDS`` whole words of two letters or more
    (CLIP's ``word</w>`` tokens): a real CLIP tokenizer holds tens of thousands, the bundled model's every word of
    its training prompts, a byte-level one (no or few merges) next to none."""
    words = 0
    for token in tokenizer.get_vocab():
        if token.endswith(END_OF_WORD) and len(token) - len(END_OF_WORD) >= 2 and token[: -len(END_OF_WORD)].isalpha():
            words += 1
            if words >= MIN_VOCABULARY_WORDS:
                return True
    return False


def unknown_words(tokenizer: Any, ids: list[int]) -> list[str]:
    """The words of token ids ``ids`` (a prompt without special tokens) that the tokenizer does not know, in order,
    without repeats.

    Words are CLIP's: the pieces up to one ending in ``</w>``; only words with a letter count (not punctuation,
    digits); special tokens are skipped. A word is unknown when a piece is the unknown token (unless that is also the
    start, end or padding token, as CLIP's is), or when it splits into pieces of which more than half are single
    bytes (``is_spelled_out``): the tokenizer learnt nothing of it and spells it byte by byte. A word known whole, or
    split into learnt sub-words ("photo" + "realistic</w>"), is known.
    """
    pieces = tokenizer.convert_ids_to_tokens(ids)
    unk = tokenizer.unk_token_id
    if unk in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        unk = None  # CLIP's is its end token: byte-level BPE never needs it, only a typed "<|endoftext|>" gives it
    special = set(tokenizer.all_special_ids) - {unk}
    unknown: list[str] = []
    word: list[int] = []
    for index, piece in zip(ids, pieces, strict=True):
        if index in special:
            word = []
            continue
        word.append(index)
        if not piece.endswith(END_OF_WORD):
            continue
        text = tokenizer.decode(word).strip()
        group = tokenizer.convert_ids_to_tokens(word)
        if any(c.isalpha() for c in text) and (unk in word or is_spelled_out(group)) and text not in unknown:
            unknown.append(text)
        word = []
    return unknown


def is_spelled_out(pieces: list[str]) -> bool:
    """Whether a word's BPE pieces are mostly single bytes: more than one piece, and more than half one character
    (``</w>`` aside)."""
    single = sum(1 for piece in pieces if len(piece.removesuffix(END_OF_WORD)) == 1)
    return len(pieces) > 1 and 2 * single > len(pieces)


BOS_TOKEN, EOS_TOKEN, END_OF_WORD = "<|startoftext|>", "<|endoftext|>", "</w>"


def byte_alphabet() -> list[str]:
    """GPT-2 / CLIP byte-level alphabet: one printable character per byte value, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def clip_tokenizer_files(
    merges: list[tuple[str, str]], pad_token: str = EOS_TOKEN, max_length: int = 77
) -> dict[str, str]:
    """File name -> text of a byte-level CLIP BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json,
    special_tokens_map.json): every byte and byte + ``</w>`` (so any text tokenizes), the ``merges``' results,
    CLIP's start/end tokens, lower-casing, ``max_length`` tokens."""
    alphabet = byte_alphabet()
    tokens = alphabet + [c + END_OF_WORD for c in alphabet] + [a + b for a, b in merges] + [BOS_TOKEN, EOS_TOKEN]
    vocab = {token: i for i, token in enumerate(tokens)}
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN, "pad_token": pad_token}
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": max_length, "do_lower_case": True, **special}
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


def clip_tokenizer(files: dict[str, str]) -> CLIPTokenizer:
    """The CLIP tokenizer of ``clip_tokenizer_files()`` output (file name -> text)."""
    return CLIPTokenizer.from_files(files)


def random_components(name: str, seed: int = 0, device: str | torch.device = "cpu") -> StableDiffusionComponents:
    """A Stable Diffusion preset's components with random weights (seeded; default initialisation), fp32, drawn on
    ``device`` and returned on the CPU, for speed measurements: fastdiff ships no SD weights. The same seed gives
    the same weights on every device of a kind; a GPU draws SD 1.5's in a fraction of a second, a host CPU takes
    seconds to tens of seconds. The tokenizer is byte-level (no merges), so prompts tokenize into more pieces than
    with the real vocabulary; the sequence length (77) is the real one."""
    if name not in SD_PRESETS:
        raise FastdiffError(f"unknown Stable Diffusion preset {name!r}; choose one of {', '.join(SD_PRESETS)}")
    preset = SD_PRESETS[name]
    log.warning("%s: random weights (fastdiff ships no Stable Diffusion weights); images will be noise", name)
    tokenizer = clip_tokenizer(clip_tokenizer_files([], preset.pad_token, preset.text_tokens))
    text_config = CLIPTextConfig(
        **preset.text, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)  # (the CUDA generators too)
    with torch.device(device):  # each model to the host as soon as it is drawn: one at a time on the device
        unet = UNet2DConditionModel(preset.unet).eval().cpu()
        vae = AutoencoderKL(preset.vae).eval().cpu()
        text_encoder = CLIPTextModel(text_config).eval().cpu()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the draws' memory back, not counted as the pipeline's
    index = {"_class_name": "StableDiffusionPipeline"}
    return StableDiffusionComponents(unet, vae, text_encoder, tokenizer, dict(preset.scheduler), index)
