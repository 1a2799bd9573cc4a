"""CLIP's tokenizer on the ``tokenizers`` library, as transformers' ``CLIPTokenizer`` (version 5) builds it, without
importing transformers (``docs/engine/kernel-plans.md``, "Loading Stable Diffusion").

Byte-level BPE with CLIP's ``</w>`` end-of-word suffix; text normalised (NFC, runs of white space to one space,
lower case), split by CLIP's pattern, wrapped in the start and end tokens. ``__call__`` and the other methods are the
part of transformers' tokenizer API that fastdiff and diffusers' ``encode_prompt`` use, with the same results
(``tests/models/test_clip_tokenizer.py``); ``to_transformers`` gives transformers' own for diffusers' pipelines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdiff.errors import FastdiffError
from fastdiff.models.weights import json_object

SPLIT_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
"""CLIP's pre-tokenisation: its special tokens, English contractions, letter runs, single digits, other runs."""
DEFAULT_SPECIAL = {
    "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}  # fmt: skip
"""transformers' defaults for the four special tokens."""
FILES = (("vocab.json", "merges.txt"), ("tokenizer.json",))
"""A tokenizer folder holds one of these sets (besides tokenizer_config.json / special_tokens_map.json)."""


@dataclass
class Tokenized:
    """``input_ids`` and ``attention_mask``: [B, L] int64 tensors, or lists of lists without ``return_tensors``."""

    input_ids: Any
    attention_mask: Any


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class CLIPTokenizer:
    """CLIP's tokenizer: ``vocab`` (token -> id) and ``merges`` (pairs, in priority order), or a ``tokenizers``
    ``backend`` read from a tokenizer.json; ``model_max_length`` tokens per prompt."""

    def __init__(
        self,
        vocab: dict[str, int] | None = None,
        merges: list[tuple[str, str]] | None = None,
        *,
        backend: Any = None,
        model_max_length: int = 77,
        name_or_path: str = "",
        **special: str,
    ) -> None:
        tokenizers = import_tokenizers()
        Regex, Tokenizer = tokenizers.Regex, tokenizers.Tokenizer
        decoders, normalizers = tokenizers.decoders, tokenizers.normalizers
        pre_tokenizers, processors, BPE = tokenizers.pre_tokenizers, tokenizers.processors, tokenizers.models.BPE

        unknown = set(special) - set(DEFAULT_SPECIAL)
        if unknown:
            raise FastdiffError(f"unknown special tokens {sorted(unknown)}")
        self.special = {**DEFAULT_SPECIAL, **special}
        if backend is None:
            if vocab is None:
                raise FastdiffError("a CLIP tokenizer needs a vocabulary")
            backend = Tokenizer(
                BPE(vocab=vocab, merges=list(merges or []), dropout=None, continuing_subword_prefix="",
                    end_of_word_suffix="</w>", fuse_unk=False, unk_token=self.special["unk_token"])
            )  # fmt: skip
            backend.normalizer = normalizers.Sequence(
                [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
            )
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="removed", invert=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )  # fmt: skip
            backend.decoder = decoders.ByteLevel()
        backend.no_padding()  # (a tokenizer.json may hold its own; __call__ pads and truncates by itself)
        backend.no_truncation()
        self.backend = backend
        self.vocab, self.merges = vocab, list(merges or [])  # (for save_pretrained's vocab.json and merges.txt)
        backend.add_special_tokens(list(dict.fromkeys(self.special.values())))  # typed in a prompt: the token, too
        ids = {name: backend.token_to_id(token) for name, token in self.special.items()}  # (added if missing)
        self.bos_token_id, self.eos_token_id = ids["bos_token"], ids["eos_token"]
        self.unk_token_id, self.pad_token_id = ids["unk_token"], ids["pad_token"]
        self.bos_token, self.eos_token = self.special["bos_token"], self.special["eos_token"]
        self.unk_token, self.pad_token = self.special["unk_token"], self.special["pad_token"]
        backend.post_processor = processors.RobertaProcessing(  # what a saved tokenizer.json says; __call__ adds
            (self.eos_token, self.eos_token_id), (self.bos_token, self.bos_token_id), False, False
        )  # the two tokens itself
        self.model_max_length = model_max_length
        self.name_or_path = name_or_path

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> CLIPTokenizer:
        """The tokenizer in a transformers tokenizer folder: vocab.json + merges.txt (or tokenizer.json), with
        tokenizer_config.json / special_tokens_map.json for the special tokens and ``model_max_length``."""
        folder = Path(folder)
        names = {name for files in FILES for name in files} | {"special_tokens_map.json", "tokenizer_config.json"}
        texts = {name: (folder / name).read_text(encoding="utf-8") for name in names if (folder / name).is_file()}
        return cls.from_files(texts, name_or_path=str(folder))

    @classmethod
    def from_files(cls, files: dict[str, str], name_or_path: str = "") -> CLIPTokenizer:
        """The tokenizer of a folder's files given as texts (file name -> text; see ``from_pretrained``)."""
        where = name_or_path or "tokenizer"
        settings: dict[str, Any] = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the map wins, as in transformers
            if name in files:
                settings.update(json_object(files[name], f"{where}/{name}"))
        special = {key: text for key in DEFAULT_SPECIAL if (text := token_text(settings.get(key))) is not None}
        max_length = settings.get("model_max_length", 77)
        if not isinstance(max_length, int) or not 0 < max_length <= 10**6:  # transformers writes 1e30 for "none"
            max_length = 77
        kwargs = dict(model_max_length=max_length, name_or_path=name_or_path, **special)
        if "vocab.json" in files and "merges.txt" in files:
            vocab = json_object(files["vocab.json"], f"{where}/vocab.json")
            return cls(vocab, parse_merges(files["merges.txt"], f"{where}/merges.txt"), **kwargs)
        if "tokenizer.json" not in files:
            need = "need vocab.json and merges.txt, or tokenizer.json"
            raise FastdiffError(f"tokenizer files missing in {where}: {need}")
        try:
            backend = import_tokenizers().Tokenizer.from_str(files["tokenizer.json"])
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise FastdiffError(f"cannot read {where}/tokenizer.json: {str(exc).splitlines()[0]}") from exc
        return cls(backend=backend, **kwargs)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab()

    @property
    def all_special_ids(self) -> list[int]:
        return sorted({self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id})

    def num_special_tokens_to_add(self) -> int:
        """The start and end tokens."""
        return 2

    def __call__(
        self,
        text: str | list[str],
        padding: bool | str = False,
        max_length: int | None = None,
        truncation: bool | str = False,
        return_tensors: str | None = None,
        add_special_tokens: bool = True,
        verbose: bool = True,
    ) -> Tokenized:
        """transformers' call on these options: ``padding="max_length"`` pads to ``max_length`` (``True`` or
        "longest": to the longest) with the padding token, ``truncation`` keeps the first ``max_length`` tokens (the
        end token last), ``return_tensors="pt"`` gives tensors. (``verbose``: accepted; nothing is logged.)"""
        texts = [text] if isinstance(text, str) else list(text)
        length = max_length if max_length is not None else self.model_max_length
        padding = {"do_not_pad": False, "longest": True}.get(padding, padding) if isinstance(padding, str) else padding
        truncation = truncation != "do_not_truncate" if isinstance(truncation, str) else truncation
        rows = []
        for encoding in self.backend.encode_batch(texts, add_special_tokens=False):  # the backend is never changed:
            ids = list(encoding.ids)  # one tokenizer serves threads at once
            if add_special_tokens:
                ids = [self.bos_token_id, *(ids[: max(length - 2, 0)] if truncation else ids), self.eos_token_id]
            elif truncation:
                ids = ids[:length]
            rows.append(ids)
        width = length if padding == "max_length" else max(map(len, rows), default=0) if padding else 0
        mask = [[1] * len(ids) + [0] * max(width - len(ids), 0) for ids in rows]
        rows = [ids + [self.pad_token_id] * max(width - len(ids), 0) for ids in rows]
        if return_tensors == "pt":
            return Tokenized(torch.tensor(rows, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64))
        if return_tensors is not None:
            raise FastdiffError(f"return_tensors={return_tensors!r}: only 'pt' or None")
        if isinstance(text, str):
            return Tokenized(rows[0], mask[0])
        return Tokenized(rows, mask)

    def tokenize(self, text: str) -> list[str]:
        """The pieces of ``text``, no special tokens."""
        return self.backend.encode(text, add_special_tokens=False).tokens

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def decode(self, ids: list[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``, CLIP's ``</w>`` read as a space (as transformers' CLIP tokenizer decodes)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text.replace("</w>", " ").strip()

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def save_pretrained(self, folder: str | Path) -> None:
        """vocab.json and merges.txt (where this tokenizer was made from them), tokenizer.json,
        tokenizer_config.json and special_tokens_map.json: what transformers 4 and 5 read back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.vocab is not None:
            (folder / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False) + "\n", encoding="utf-8")
            merges = "".join(f"{a} {b}\n" for a, b in self.merges)
            (folder / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": self.model_max_length, **self.special}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "special_tokens_map.json").write_text(json.dumps(self.special, indent=2) + "\n")


def import_tokenizers() -> Any:
    """The tokenizers package, or a FastdiffError saying how to install it."""
    try:
        import tokenizers
        import tokenizers.models
    except ImportError as exc:
        raise FastdiffError(
            "Stable Diffusion needs the tokenizers package for its CLIP tokenizer: pip install 'fastdiff[sd]'"
        ) from exc
    return tokenizers


def parse_merges(text: str, source: str) -> list[tuple[str, str]]:
    """merges.txt's pairs (its ``#version`` line and blank lines skipped)."""
    merges = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise FastdiffError(f"{source}:{number}: a merge is two tokens, got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def to_transformers(tokenizer: CLIPTokenizer) -> Any:
    """transformers' ``CLIPTokenizer`` with the same files, for diffusers' pipelines (imports transformers)."""
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return transformers.CLIPTokenizerFast.from_pretrained(tmp, local_files_only=True)
