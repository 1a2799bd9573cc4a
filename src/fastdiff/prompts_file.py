"""Prompts files: one prompt a line, or JSONL lines with ``prompt`` and optional ``negative_prompt``, ``seed``,
``guidance`` and ``n`` (a file whose first non-blank line starts with ``{``). ``fastdiff generate --prompts`` makes
its jobs from them, ``fastdiff loadtest --prompts`` its requests. Every problem is a one-line ``FastdiffError``
naming the line, before any work.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from fastdiff.cli_args import MAX_SEED
from fastdiff.errors import FastdiffError

PROMPT_KEYS = ("prompt", "negative_prompt", "seed", "guidance", "n")
"""The keys of a JSONL prompts line (``prompt`` required)."""


@dataclass(frozen=True)
class PromptLine:
    """One line of a prompts file, with the defaults of ``--guidance`` and ``--negative-prompt`` filled in."""

    line: int
    """The line number in the file (1-based, counting blank lines)."""
    prompt: str
    negative_prompt: str
    guidance: float
    seed: int | None
    """The seed of the line's first image (then seed+1, ...); None: image i takes ``first_seed + i``."""
    n: int


def read_prompts(path: Path, guidance: float, negative_prompt: str) -> tuple[list[PromptLine], str]:
    """The lines of a prompts file (module docstring: plain text or JSONL) and the file's sha256; every problem
    is a one-line FastdiffError naming the line."""
    where = f"--prompts {path}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FastdiffError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise FastdiffError(f"{where} is a folder, not a file") from None
    except OSError as exc:
        raise FastdiffError(f"cannot read {where}: {exc.strerror or exc}") from None
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    numbered: list[tuple[int, str]] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise FastdiffError(f"{where} line {number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if text:
            numbered.append((number, text))
    if not numbered:
        raise FastdiffError(f"{where} holds no prompts")
    if not numbered[0][1].startswith("{"):
        return [PromptLine(number, text, negative_prompt, guidance, None, 1) for number, text in numbered], digest
    lines = [
        prompt_line(f"{where} line {number}", number, text, guidance, negative_prompt) for number, text in numbered
    ]
    return lines, digest


def prompt_line(where: str, number: int, text: str, guidance: float, negative_prompt: str) -> PromptLine:
    """One JSONL line: an object with ``prompt`` and optional ``negative_prompt``, ``seed``, ``guidance``, ``n``."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FastdiffError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise FastdiffError(f'{where}: expected a JSON object like {{"prompt": "..."}}, got {text[:60]}')
    unknown = [key for key in record if key not in PROMPT_KEYS]
    if unknown:
        raise FastdiffError(f"{where}: unknown key {', '.join(map(repr, unknown))} (known: {', '.join(PROMPT_KEYS)})")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise FastdiffError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    negative = record.get("negative_prompt", negative_prompt)
    if not isinstance(negative, str):
        raise FastdiffError(f'{where}: "negative_prompt" must be a string, got {negative!r}')
    scale = record.get("guidance", guidance)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise FastdiffError(f'{where}: "guidance" must be a finite number >= 0, got {scale!r}')
    seed = record.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise FastdiffError(f'{where}: "seed" must be an integer in 0..{MAX_SEED}, got {seed!r}')
    count = record.get("n", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise FastdiffError(f'{where}: "n" must be a positive integer, got {count!r}')
    return PromptLine(number, prompt, negative, float(scale), seed, count)
