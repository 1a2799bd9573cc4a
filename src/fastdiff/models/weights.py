"""Reading weight files and loading them into a module with one-line errors for every mismatch."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


def check_allowed(allowed: Mapping[str, tuple], key: str, value: object, source: str = "") -> None:
    """FastdiffError if ``value`` of config ``key`` is not one of ``allowed[key]``."""
    if value not in allowed[key]:
        supported = ", ".join(map(repr, allowed[key]))
        raise FastdiffError(f"{source + ': ' if source else ''}unsupported {key}={value!r} (supported: {supported})")


def config_from_dict(
    cls: type[ConfigT],
    config: Mapping[str, Any],
    source: str = "config",
    allowed: Mapping[str, tuple] | None = None,
    ignored: frozenset[str] = frozenset(),
) -> ConfigT:
    """A config dataclass from a diffusers ``config.json`` dict: its fields are taken, keys of ``allowed`` that are
    not fields must hold a supported value, ``_*`` and ``ignored`` keys are skipped, others are logged and skipped;
    a bad value is a one-line FastdiffError naming ``source``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in config.items():
        if key in fields:
            kwargs[key] = value
        elif allowed is not None and key in allowed:
            check_allowed(allowed, key, value, source)
        elif not key.startswith("_") and key not in ignored:
            log.warning("%s: ignoring unknown config key %r", source, key)
    try:
        return cls(**kwargs)
    except FastdiffError as exc:
        raise FastdiffError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:  # e.g. a string where a number belongs
        raise FastdiffError(f"{source}: invalid config value: {exc}") from None


WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.bin")


def find_weights(root: Path) -> Path:
    """The weight file in ``root`` (safetensors preferred), or a FastdiffError naming what is missing."""
    for name in WEIGHT_NAMES:
        if (root / name).is_file():
            return root / name
    raise FastdiffError(f"no weights in {root}: expected one of {', '.join(WEIGHT_NAMES)}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors or a torch .bin file, on the CPU."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated file
        raise FastdiffError(f"cannot read weights {path}: {type(exc).__name__}: {exc}") from exc


def read_json_object(file: Path) -> dict:
    """The JSON object (dict) in ``file``; a missing file, bad JSON or a non-object raise a one-line error."""
    if not file.is_file():
        raise FastdiffError(f"missing {file}")
    return json_object(file.read_text(), str(file))


def json_object(text: str, source: str) -> dict:
    """The JSON object (dict) in ``text`` (read from ``source``); bad JSON or a non-object raise a one-line error."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FastdiffError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise FastdiffError(f"{source}: expected a JSON object, got {type(data).__name__}")
    return data


def load_state_dict_checked(
    model: nn.Module, state: dict[str, torch.Tensor], source: str, assign: bool = False
) -> None:
    """Copy ``state`` into ``model``; missing/unexpected keys or shape mismatches raise a one-line error.

    ``assign=True`` makes the state's tensors the model's parameters (for models built on the meta device).
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise FastdiffError(f"{source}: {len(missing)} weights missing, first: {missing[0]}")
    if unexpected:
        raise FastdiffError(f"{source}: {len(unexpected)} unexpected weights, first: {unexpected[0]}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise FastdiffError(
                f"{source}: weight {key} has shape {tuple(value.shape)}, model expects {tuple(own[key].shape)}"
            )
    model.load_state_dict(state, strict=True, assign=assign)
