"""The prompts of the text-to-image recipe and the CLIP tokenizer that holds every prompt word whole.

Each Fashion-MNIST class has a few nouns (``CLASS_NOUNS``); the training prompts are every template of
``PROMPT_TEMPLATES`` filled with each of them (``class_prompts``), plus the empty prompt of classifier-free guidance.
The tokenizer is CLIP's byte-level BPE with merges learnt on those prompts' words (``learn_merges``), so each word is
one token and any other text still tokenizes.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import torch

from fastdiff.errors import FastdiffError
from fastdiff.models.clip_tokenizer import CLIPTokenizer
from fastdiff.models.stable_diffusion import END_OF_WORD, clip_tokenizer_files

# ---------------------------------------------------------------- prompts

CLASS_NOUNS: tuple[tuple[str, ...], ...] = (
    ("t-shirt", "tshirt", "tee", "tee shirt", "top", "t-shirt/top", "t-shirts", "tees", "tops"),
    ("trousers", "pants", "jeans", "slacks", "trouser", "pair of trousers", "pair of pants"),
    ("pullover", "sweater", "jumper", "sweatshirt", "pullovers", "sweaters"),
    ("dress", "gown", "summer dress", "dresses"),
    ("coat", "jacket", "overcoat", "winter coat", "coats", "jackets"),
    ("sandal", "sandals", "strappy sandal"),
    ("shirt", "blouse", "button-down shirt", "shirts", "blouses"),
    ("sneaker", "sneakers", "trainers", "running shoe", "running shoes"),
    ("bag", "handbag", "purse", "tote bag", "shoulder bag", "bags", "handbags"),
    ("ankle boot", "ankle boots", "boot", "boots"),
)
"""What a user may call each Fashion-MNIST class (index = label); the first is the canonical name."""

PLURAL_NOUNS = frozenset(
    {
        *("t-shirts", "tees", "tops", "trousers", "pants", "jeans", "slacks", "pullovers", "sweaters", "dresses"),
        *("coats", "jackets", "sandals", "shirts", "blouses", "sneakers", "trainers", "running shoes", "bags"),
        *("handbags", "ankle boots", "boots"),
    }
)
"""Nouns that take no article ("a photo of trousers")."""

PROMPT_TEMPLATES = (
    "{noun}",
    "{phrase}",
    "a photo of {phrase}",
    "a picture of {phrase}",
    "an image of {phrase}",
    "a product photo of {phrase}",
    "{phrase}, product photo",
    "{noun}, product photo",
    "a black and white photo of {phrase}",
    "a grayscale photo of {phrase}",
    "a small photo of {phrase}",
)
"""``{noun}``: the bare noun ("ankle boot"); ``{phrase}``: with its article ("an ankle boot", "trousers")."""

CANONICAL_TEMPLATE = "a photo of {phrase}"
EMPTY_PROMPT = ""
"""The unconditional prompt of classifier-free guidance (what a dropped prompt becomes)."""

CLIP_WORD = re.compile(r"[a-z]+|[0-9]|[^\sa-z0-9]+")
"""CLIP's pre-tokenizer pattern (letters, single digits, runs of other symbols) on lowercase ASCII."""


def noun_phrase(noun: str) -> str:
    """``noun`` with its indefinite article ("a bag", "an ankle boot"); plurals stay bare ("trousers")."""
    if noun in PLURAL_NOUNS:
        return noun
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def class_prompts(label: int) -> tuple[str, ...]:
    """Every training prompt of class ``label`` (0..9): each template filled with each of its nouns, no repeats."""
    if not 0 <= label < len(CLASS_NOUNS):
        raise FastdiffError(f"Fashion-MNIST class {label!r} out of range 0..{len(CLASS_NOUNS) - 1}")
    prompts = [t.format(noun=n, phrase=noun_phrase(n)) for n in CLASS_NOUNS[label] for t in PROMPT_TEMPLATES]
    return tuple(dict.fromkeys(prompts))


def canonical_prompts() -> list[str]:
    """One prompt per class, in label order ("a photo of a t-shirt", ..., "a photo of an ankle boot")."""
    return [CANONICAL_TEMPLATE.format(phrase=noun_phrase(nouns[0])) for nouns in CLASS_NOUNS]


def random_prompt(label: int, rng: random.Random) -> str:
    """A prompt for class ``label`` drawn uniformly from ``class_prompts(label)``."""
    return rng.choice(class_prompts(label))


def prompt_table() -> tuple[list[str], list[int]]:
    """(prompts, labels): every class's prompts in label order, then the empty prompt (label -1)."""
    prompts, labels = [], []
    for label in range(len(CLASS_NOUNS)):
        for prompt in class_prompts(label):
            prompts.append(prompt)
            labels.append(label)
    return prompts + [EMPTY_PROMPT], labels + [-1]


# ---------------------------------------------------------------- tokenizer

TEXT_TOKENS = 77
"""CLIP's sequence length (SD's ``model_max_length``)."""


def prompt_words() -> list[str]:
    """The distinct CLIP words (pre-tokenized pieces) of every training prompt, sorted."""
    prompts, _ = prompt_table()
    return sorted({word for prompt in prompts for word in CLIP_WORD.findall(prompt.lower())})


def learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges that make each word of ``words`` (ASCII) one token: BPE training (most frequent pair
    first, ties broken by the pair's text) until no word has two symbols left."""
    pieces = [[*w[:-1], w[-1] + END_OF_WORD] for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for symbols in pieces:
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for k, symbols in enumerate(pieces):
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            pieces[k] = merged


def tokenizer_files() -> dict[str, str]:
    """File name -> text of the CLIP tokenizer (``clip_tokenizer_files``): the byte-level alphabet (so any text
    tokenizes), every prompt word whole, SD 1.x's special tokens and padding (<|endoftext|>), 77 tokens."""
    return clip_tokenizer_files(learn_merges(prompt_words()), max_length=TEXT_TOKENS)


def write_tokenizer(folder: Path) -> None:
    """Write ``tokenizer_files()`` into ``folder`` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")


def build_tokenizer() -> CLIPTokenizer:
    """The CLIP tokenizer of ``tokenizer_files()``."""
    return CLIPTokenizer.from_files(tokenizer_files())


def tokenize(tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    """Token ids [len(prompts), model_max_length] as SD's ``encode_prompt`` makes them (padded, truncated)."""
    max_length = tokenizer.model_max_length
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return tokens.input_ids
