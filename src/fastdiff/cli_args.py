"""What every ``fastdiff`` subcommand's parser shares: the parser and help formatter, argument types, the commands'
one-line helps, the choices of --sampler and --dtype, the default model.

It sits below every command module and imports neither torch nor any other part of fastdiff but
``fastdiff.errors``, so a subcommand imports it without importing the root CLI, and ``fastdiff --help`` stays
fast. The sampler names are copied here from ``fastdiff.samplers`` (which imports torch); a test keeps the copies
equal.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from pathlib import Path

from fastdiff.errors import FastdiffError

DEFAULT_MODEL = "fashion-mnist"
"""The model a command runs when ``--model`` is not given: the bundled Fashion-MNIST ConvNeXt U-Net."""
DEFAULT_GUIDANCE = 7.5
"""Classifier-free guidance when none is given: diffusers' ``StableDiffusionPipeline`` default (the bundled
fashion-mnist-t2i is sampled at 3 in its documentation)."""

PAD_WAIT = 0.1
"""``serve``'s default ``--pad-wait``: the extra wait of a batch that would run padded, as a fraction of its run
size's sampling time (``fastdiff.serve.batcher``)."""

MAX_SEED = 2**63 - 1
"""Largest seed (``fastdiff.samplers.noise.MAX_SEED``): seeds are int64 on the device."""

SAMPLER_SCHEDULERS = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmsolver++": "DPMSolverMultistepScheduler",
    "dpmsolver++_sde": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
}
"""``fastdiff.samplers.SAMPLER_SCHEDULERS``: --sampler name -> the diffusers scheduler whose loop it equals."""
SAMPLERS = tuple(SAMPLER_SCHEDULERS)
"""The --sampler choices (``fastdiff.samplers.SAMPLERS``)."""
KARRAS_SAMPLERS = ("euler", "dpmsolver++", "dpmsolver++_sde", "unipc")
"""The samplers that take Karras sigmas (``fastdiff.samplers.KARRAS_SAMPLERS``)."""
DTYPES = ("fp32", "fp16", "bf16", "fp8")
"""The model dtypes of the sampling commands (``fastdiff.pipelines.DTYPE_NAMES``)."""
DTYPE_CHOICES = ("auto", *DTYPES)
"""Their --dtype choices: "auto" (the default) is fp16 on a GPU, where the engine's shipped kernel plans are, and fp32
on the CPU, whose fast path it is (``resolve_dtype_choice``)."""
DTYPE_HELP = (
    "model precision; auto: fp16 on a GPU, fp32 on the CPU (where fp16/bf16 run many times slower); fp8: fp16 "
    "activations with e4m3 convs after each GroupNorm (Hopper GPUs, engine backend)"
)


def resolve_dtype_choice(dtype: str, device: str) -> str:
    """--dtype with "auto" resolved for --device (``auto``: a GPU if torch sees one)."""
    if dtype != "auto":
        return dtype
    if device == "auto":
        import torch

        return "fp16" if torch.cuda.is_available() else "fp32"
    return "fp16" if str(device).startswith("cuda") else "fp32"


COMMANDS = {
    "sample": ("generate images and write a PNG grid", "fastdiff.cli:add_sample_arguments"),
    "generate": (
        "generate many images into a folder (resumable; one process or many under torchrun)",
        "fastdiff.generate:add_arguments",
    ),
    "train": (
        "train a ConvNeXt U-Net on Fashion-MNIST (resumable) and export it",
        "fastdiff.train.cli:add_arguments",
    ),
    "fid": (
        "Fréchet distance of generated images to Fashion-MNIST (FD-FMNIST) or Inception FID",
        "fastdiff.quality.cli:add_arguments",
    ),
    "bench": (
        "time, memory, energy and quality of fastdiff vs diffusers and torch.compile",
        "fastdiff.bench.cli:add_arguments",
    ),
    "profile": (
        "op-class time breakdown, load-to-first-step, latency, memory, energy and roofline of one model",
        "fastdiff.profile.cli:add_arguments",
    ),
    "serve": (
        "HTTP image service with dynamic batching, a browser page and Prometheus metrics",
        "fastdiff.serve.cli:add_serve_arguments",
    ),
    "loadtest": (
        "load a running fastdiff server: throughput, latency percentiles, 429s and errors",
        "fastdiff.serve.cli:add_loadtest_arguments",
    ),
    "tune": (
        "make a kernel plan: time each op's kernels for one model and batch on this GPU, write the choice",
        "fastdiff.tune:add_arguments",
    ),
    "export": (
        "export the U-Net as ONNX (dynamic batch), checked in ONNX Runtime",
        "fastdiff.export:add_arguments",
    ),
}
"""Each ``fastdiff`` command: its one-line help and the ``module:function`` that adds its flags (imported only when
the command runs or shows its help)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends a flag's help with "(default: X)" once: not where the help already names its default, nor for a flag
    without one (None, a switch's False, a required flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        no_default = action.default is None or action.default is False or action.required
        if no_default or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags may be added on first use, and whose errors are one line (exit code 2).

    ``add_parser(name, flags=fn)`` (this class is the parser class of its subparsers) keeps ``fn``, which adds
    the command's flags, until the command is parsed or its help or usage is shown: ``fastdiff --help`` imports
    no command module, and ``fastdiff sample --help`` only sample's. ``complete()`` adds them now.
    """

    def __init__(self, *args: object, flags: Callable[[argparse.ArgumentParser], object] | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._flags = flags

    def complete(self) -> CommandParser:
        """Add the pending flags (if any) now; returns the parser."""
        if self._flags is not None:
            add, self._flags = self._flags, None
            add(self)
        return self

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.complete()
        return super().format_help()

    def format_usage(self) -> str:
        self.complete()
        return super().format_usage()

    def error(self, message: str):  # type: ignore[override]
        """One line on stderr, exit code 2 (argparse prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def import_flags(target: str) -> Callable[[argparse.ArgumentParser], object]:
    """The function a ``"module:function"`` of ``COMMANDS`` names, imported when it is called."""
    module, function = target.split(":")

    def add(parser: argparse.ArgumentParser) -> object:
        return getattr(importlib.import_module(module), function)(parser)

    return add


def add_flags_later(parser: argparse.ArgumentParser, add: Callable[[argparse.ArgumentParser], object]) -> None:
    """``add(parser)`` when a ``CommandParser`` is first used (see there); now for any other parser."""
    if isinstance(parser, CommandParser):
        parser._flags = add
    else:
        add(parser)


def add_command(subparsers: argparse._SubParsersAction, name: str, add: Callable | None = None) -> None:
    """Add ``COMMANDS[name]`` to ``subparsers``: its flags from ``add`` (default: its ``module:function``), now
    or, with a ``CommandParser``, when the command is used."""
    help_line, target = COMMANDS[name]
    parser = subparsers.add_parser(name, help=help_line, formatter_class=HelpFormatter)
    add_flags_later(parser, add or import_flags(target))


# --- argument types: argparse turns their ArgumentTypeError into "argument --flag: MESSAGE" -------------------


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed, an integer in 0..2^63 - 1."""
    value = _integer(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_SEED} (2^63 - 1), got {value}")
    return value


def port_int(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


def finite_nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (not nan, not inf)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def check_seed_range(first: int, count: int, flag: str = "--seed") -> None:
    """Image k of ``count`` uses seed ``first + k``: the last must be a seed too (one-line FastdiffError)."""
    if first + count - 1 > MAX_SEED:
        raise FastdiffError(
            f"{flag} {first} with {count} images goes past the largest seed {MAX_SEED}: use a seed <= "
            f"{MAX_SEED - count + 1}"
        )


def add_plan_argument(p: argparse.ArgumentParser) -> None:
    """``--plan FILE``: the kernel plan the engine takes (``fastdiff tune`` writes one)."""
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="kernel plan (JSON, from fastdiff tune): the engine runs the kernels it names and times nothing "
        "(default: a plan shipped for this GPU, or the one the engine made earlier on this machine, else it tunes)",
    )


FULL_GUIDANCE = (0.0, 1.0)
"""The default guidance interval: every step guided (diffusers' ``StableDiffusionPipeline``)."""


def check_guidance_interval(interval: object, name: str = "guidance interval") -> tuple[float, float]:
    """``interval`` as a (start, stop) pair of floats with 0 <= start < 1 and start <= stop <= 1 (diffusers'
    guider checks), else a one-line error naming ``name``."""
    try:
        start, stop = (float(v) for v in interval)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise FastdiffError(f"{name} must be two numbers (start, stop), got {interval!r}") from None
    if not (0.0 <= start < 1.0 and start <= stop <= 1.0):
        raise FastdiffError(f"{name} needs 0 <= start < 1 and start <= stop <= 1, got ({start}, {stop})")
    return start, stop
