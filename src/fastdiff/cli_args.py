"""What every ``fastdiff`` subcommand's parser shares: the help formatter, argument types, the default model.

It sits below every command module (and imports neither torch nor any other part of fastdiff), so a subcommand
imports it without importing the root CLI, and ``fastdiff --help`` stays fast."""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "fashion-mnist"
"""The model a command runs when ``--model`` is not given: the bundled Fashion-MNIST ConvNeXt U-Net."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends a flag's help with "(default: X)" once: not where the help already names its default, nor for a flag
    without one (None, a switch's False, a required flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        no_default = action.default is None or action.default is False or action.required
        if no_default or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
