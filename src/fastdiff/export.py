"""``fastdiff export --format onnx``: the U-Net ``unet(sample, timestep)`` as ONNX, checked in ONNX Runtime.

The graph is traced by torch's TorchScript-based ONNX exporter (``dynamo=False``: it needs no onnxscript and runs
offline) at batch 2 with a dynamic batch axis. Before anything is kept, ONNX Runtime (CPU) runs it at
``CHECK_BATCHES`` against the eager fp32 model: max |diff| must be at most ``TOLERANCE``. The output folder is
built beside its destination and renamed into place, so it is either complete or absent; it holds ``unet.onnx``
and ``model.json`` (inputs, outputs, the check, the scheduler config). torch is imported where it is used.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from fastdiff.atomic import check_output_location, write_folder_atomic
from fastdiff.errors import FastdiffError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

FORMATS = ("onnx",)
OPSET = 17
TRACE_BATCH = 2
"""Traced at batch 2: at batch 1 a model may take its scalar-timestep path, which would not generalize."""
CHECK_BATCHES = (1, 3)
TOLERANCE = 1e-4
ONNX_FILE = "unet.onnx"
INFO_FILE = "model.json"
INPUT_NAMES = ("sample", "timestep")
OUTPUT_NAMES = ("model_output",)


def load_fp32_unet(model: str) -> nn.Module:
    """The U-Net of ``model`` (preset or directory) in fp32 on the CPU; a preset without weights is seeded."""
    import torch

    from fastdiff.pipelines import Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Pipeline.from_pretrained(model, device="cpu", dtype="fp32").unet.eval()


def example_inputs(unet: nn.Module, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded (sample [B, C, H, W] fp32, timestep [B] int64) for the U-Net."""
    import torch

    cfg = unet.config
    size = cfg.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, cfg.in_channels, height, width, generator=gen)
    timestep = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int64)
    return sample, timestep


def write_onnx(unet: nn.Module, path: Path, opset: int) -> None:
    """Trace ``unet`` to ``path`` with a dynamic batch axis on every input and output."""
    import torch

    dynamic_axes = {name: {0: "batch"} for name in (*INPUT_NAMES, *OUTPUT_NAMES)}
    with warnings.catch_warnings():
        # the TorchScript exporter warns that it is the legacy path and about traced shape checks; both expected
        warnings.simplefilter("ignore")
        torch.onnx.export(
            unet,
            example_inputs(unet, TRACE_BATCH, seed=0),
            str(path),
            dynamo=False,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes=dynamic_axes,
            opset_version=opset,
        )


def check_onnx(unet: nn.Module, path: Path, batches: tuple[int, ...], tolerance: float) -> dict[str, float]:
    """Max |ONNX Runtime - eager| per batch size; FastdiffError above ``tolerance``."""
    import onnx
    import onnxruntime as ort
    import torch

    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    diffs = {}
    for batch in batches:
        sample, timestep = example_inputs(unet, batch, seed=batch + 1)
        with torch.no_grad():
            expected = unet(sample, timestep).numpy()
        (got,) = session.run(list(OUTPUT_NAMES), {"sample": sample.numpy(), "timestep": timestep.numpy()})
        if got.shape != expected.shape:
            raise FastdiffError(f"ONNX Runtime returned shape {got.shape} at batch {batch}, eager {expected.shape}")
        diff = float(abs(got - expected).max())
        if not diff <= tolerance:
            raise FastdiffError(
                f"ONNX Runtime differs from eager fp32 by {diff:.3g} at batch {batch} (limit {tolerance:g})"
            )
        diffs[str(batch)] = diff
    return diffs


def model_description(model: str, unet: nn.Module, opset: int, diffs: dict[str, float]) -> dict:
    """The ``model.json`` record: what the ONNX file takes and returns, and how it was checked."""
    import onnxruntime as ort
    import torch

    sample, _ = example_inputs(unet, 1, seed=0)
    _, channels, height, width = sample.shape
    out_channels = unet.config.out_channels
    return {
        "format": "onnx",
        "file": ONNX_FILE,
        "model": model,
        "model_class": type(unet).__name__,
        "opset": opset,
        "inputs": [
            {"name": "sample", "dtype": "float32", "shape": ["batch", channels, height, width]},
            {"name": "timestep", "dtype": "int64", "shape": ["batch"]},
        ],
        "outputs": [{"name": "model_output", "dtype": "float32", "shape": ["batch", out_channels, height, width]}],
        "check": {
            "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
            "reference": "eager fp32",
            "max_abs_diff": diffs,
            "tolerance": TOLERANCE,
        },
        "torch": torch.__version__,
        "scheduler_config": getattr(unet, "scheduler_config", None),
    }


def export_onnx(model: str, out_dir: Path, opset: int = OPSET, overwrite: bool = False) -> dict:
    """Export ``model``'s U-Net to ``out_dir`` (all or nothing); returns the ``model.json`` record."""
    out_dir = Path(out_dir)
    check_output_location(out_dir, "--out", folder=True)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FastdiffError(f"--out {out_dir} exists and is not empty (add --overwrite to replace it)")
    try:
        import onnx  # noqa: F401  (the exporter and the check need both)
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise FastdiffError(f"fastdiff export needs {exc.name}: pip install 'fastdiff[onnx]'") from None
    check_opset(opset)
    unet = load_fp32_unet(model)
    results: dict = {}

    def fill(staging: Path) -> None:
        write_onnx(unet, staging / ONNX_FILE, opset)
        results["diffs"] = check_onnx(unet, staging / ONNX_FILE, CHECK_BATCHES, TOLERANCE)
        results["record"] = model_description(model, unet, opset, results["diffs"])
        (staging / INFO_FILE).write_text(json.dumps(results["record"], indent=1) + "\n")

    write_folder_atomic(out_dir, fill)
    diffs, record = results["diffs"], results["record"]
    log.info("wrote %s: %s checked in ONNX Runtime, max |diff| %s", out_dir, ONNX_FILE, diffs)
    return record


def check_opset(opset: int) -> None:
    """``opset`` must be one that torch's TorchScript exporter writes (7..20 in torch 2.13): checked before any
    loading."""
    from torch.onnx import _constants

    low = getattr(_constants, "ONNX_MIN_OPSET", 7)
    high = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", None)
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < low or (high is not None and opset > high):
        raise FastdiffError(f"--opset must be in {low}..{high if high is not None else ''}, got {opset!r}")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand (sets ``func=run_export``)."""
    from fastdiff.cli_args import add_command

    add_command(subparsers, "export", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff export`` (sets ``func=run_export``)."""
    from fastdiff.cli_args import DEFAULT_MODEL, positive_int

    p.description = (
        "Export the U-Net unet(sample, timestep) -> model_output as ONNX with a dynamic batch axis "
        f"into --out ({ONNX_FILE} + {INFO_FILE}). ONNX Runtime (CPU) must match eager fp32 within {TOLERANCE:g} "
        f"at batch sizes {', '.join(map(str, CHECK_BATCHES))}, else nothing is written."
    )
    p.add_argument("--format", default="onnx", choices=FORMATS, help="export format")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or model directory")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--opset", type=positive_int, default=OPSET, help="ONNX opset version")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    export_onnx(args.model, args.out, opset=args.opset, overwrite=args.overwrite)
    return 0
