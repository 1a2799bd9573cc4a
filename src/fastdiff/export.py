"""``fastdiff export --format onnx``: a model's graphs as ONNX, checked in ONNX Runtime.

Unconditional models: the U-Net ``unet(sample, timestep)`` (``unet.onnx``). Its timestep input is int64 by
default (as before); ``timestep_dtype="float32"`` (``--timestep-dtype float32``) exports a float timestep, which
the samplers with fractional timesteps (Euler, DPM-Solver++ with Karras sigmas, ...) need.

Text-to-image models (``is_text_to_image_dir``: fashion-mnist-t2i, a diffusers StableDiffusionPipeline
directory): three graphs, ``text_encoder.onnx`` (input_ids int64 [B, L] -> last_hidden_state), ``unet.onnx``
(sample, timestep float32 [B], encoder_hidden_states -> model_output) and ``vae_decoder.onnx`` (the sampler's
latents -> image: ``vae.decode(latents / scaling_factor)``, as ``TextToImagePipeline`` decodes), plus the
tokenizer and scheduler folders copied from the model; ``model.json`` says how the parts fit together.

Each graph is traced by torch's TorchScript-based ONNX exporter (``dynamo=False``: it needs no onnxscript and runs
offline) at batch 2 with a dynamic batch axis. Before anything is kept, ONNX Runtime (CPU) runs it at
``CHECK_BATCHES`` against the eager fp32 model: max |diff| must be at most its tolerance (``TOLERANCE`` for the
U-Net, ``TEXT_TOLERANCE`` and ``VAE_TOLERANCE``). The output folder is built beside its destination and renamed
into place, so it is either complete or absent; it holds the graphs and ``model.json`` (inputs, outputs, the
check, the scheduler config). torch is imported where it is used.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
TIMESTEP_DTYPES = ("int64", "float32")
TEXT_TOLERANCE = 1e-4
"""Text encoder: max |ONNX Runtime - eager| of last_hidden_state (layer-normed, values of order 1)."""
VAE_TOLERANCE = 1e-4
"""VAE decoder: max |ONNX Runtime - eager| of the image (values about [-1, 1])."""
TEXT_ENCODER_FILE = "text_encoder.onnx"
VAE_DECODER_FILE = "vae_decoder.onnx"
COPIED_FOLDERS = ("tokenizer", "scheduler")
"""Folders of a text-to-image model copied as they are into the export."""


def load_fp32_unet(model: str) -> nn.Module:
    """The U-Net of ``model`` (preset or directory) in fp32 on the CPU; a preset without weights is seeded."""
    import torch

    from fastdiff.pipelines import Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Pipeline.from_pretrained(model, device="cpu", dtype="fp32").unet.eval()


def example_inputs(
    unet: nn.Module, batch: int, seed: int, timestep_dtype: str = "int64"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded (sample [B, C, H, W] fp32, timestep [B]) for the U-Net: int64 timesteps in [0, 1000), or with
    ``timestep_dtype="float32"`` fractional ones in [0, 999]."""
    import torch

    cfg = unet.config
    size = cfg.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, cfg.in_channels, height, width, generator=gen)
    if timestep_dtype == "float32":
        timestep = torch.rand(batch, generator=gen) * 999
    else:
        timestep = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int64)
    return sample, timestep


def trace_onnx(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    path: Path,
    opset: int,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
) -> None:
    """Trace ``module`` on ``inputs`` to ``path`` with a dynamic batch axis on every input and output."""
    import torch

    dynamic_axes = {name: {0: "batch"} for name in (*input_names, *output_names)}
    with warnings.catch_warnings():
        # the TorchScript exporter warns that it is the legacy path and about traced shape checks; both expected
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            inputs,
            str(path),
            dynamo=False,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            opset_version=opset,
        )


def write_onnx(unet: nn.Module, path: Path, opset: int, timestep_dtype: str = "int64") -> None:
    """Trace the unconditional ``unet`` to ``path`` with a dynamic batch axis on every input and output."""
    inputs = example_inputs(unet, TRACE_BATCH, seed=0, timestep_dtype=timestep_dtype)
    trace_onnx(unet, inputs, path, opset, INPUT_NAMES, OUTPUT_NAMES)


def check_graph(
    module: nn.Module,
    path: Path,
    make_inputs: Callable[[int, int], dict[str, torch.Tensor]],
    batches: tuple[int, ...],
    tolerance: float,
    what: str = "",
) -> dict[str, float]:
    """Max |ONNX Runtime - eager| per batch size of the graph at ``path`` (one output) on
    ``make_inputs(batch, seed)``; FastdiffError above ``tolerance``."""
    import onnx
    import onnxruntime as ort
    import torch

    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    label = f"{what}: " if what else ""
    diffs = {}
    for batch in batches:
        inputs = make_inputs(batch, batch + 1)
        with torch.no_grad():
            expected = module(*inputs.values()).numpy()
        got = session.run(None, {name: value.numpy() for name, value in inputs.items()})[0]
        if got.shape != expected.shape:
            raise FastdiffError(
                f"{label}ONNX Runtime returned shape {got.shape} at batch {batch}, eager {expected.shape}"
            )
        diff = float(abs(got - expected).max())
        if not diff <= tolerance:
            raise FastdiffError(
                f"{label}ONNX Runtime differs from eager fp32 by {diff:.3g} at batch {batch} (limit {tolerance:g})"
            )
        diffs[str(batch)] = diff
    return diffs


def check_onnx(
    unet: nn.Module, path: Path, batches: tuple[int, ...], tolerance: float, timestep_dtype: str = "int64"
) -> dict[str, float]:
    """Max |ONNX Runtime - eager| per batch size of the unconditional U-Net; FastdiffError above ``tolerance``."""

    def make_inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
        sample, timestep = example_inputs(unet, batch, seed, timestep_dtype)
        return {"sample": sample, "timestep": timestep}

    return check_graph(unet, path, make_inputs, batches, tolerance)


def model_description(
    model: str, unet: nn.Module, opset: int, diffs: dict[str, float], timestep_dtype: str = "int64"
) -> dict:
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
            {"name": "timestep", "dtype": timestep_dtype, "shape": ["batch"]},
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


def export_onnx(
    model: str, out_dir: Path, opset: int = OPSET, overwrite: bool = False, timestep_dtype: str | None = None
) -> dict:
    """Export ``model`` to ``out_dir`` (all or nothing); returns the ``model.json`` record.

    An unconditional model: its U-Net, timestep int64 unless ``timestep_dtype="float32"``. A text-to-image model
    (``export_text_to_image``): text encoder, U-Net (timestep float32 unless ``timestep_dtype="int64"``) and VAE
    decoder."""
    from fastdiff.pipelines.text_to_image import is_text_to_image_dir

    out_dir = Path(out_dir)
    if timestep_dtype is not None and timestep_dtype not in TIMESTEP_DTYPES:
        raise FastdiffError(f"--timestep-dtype must be one of {', '.join(TIMESTEP_DTYPES)}, got {timestep_dtype!r}")
    check_output_location(out_dir, "--out", folder=True)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FastdiffError(f"--out {out_dir} exists and is not empty (add --overwrite to replace it)")
    try:
        import onnx  # noqa: F401  (the exporter and the check need both)
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise FastdiffError(f"fastdiff export needs {exc.name}: pip install 'fastdiff[onnx]'") from None
    check_opset(opset)
    if is_text_to_image_dir(model):
        return export_text_to_image(model, out_dir, opset, timestep_dtype or "float32")
    timestep_dtype = timestep_dtype or "int64"
    unet = load_fp32_unet(model)
    results: dict = {}

    def fill(staging: Path) -> None:
        write_onnx(unet, staging / ONNX_FILE, opset, timestep_dtype)
        results["diffs"] = check_onnx(unet, staging / ONNX_FILE, CHECK_BATCHES, TOLERANCE, timestep_dtype)
        results["record"] = model_description(model, unet, opset, results["diffs"], timestep_dtype)
        (staging / INFO_FILE).write_text(json.dumps(results["record"], indent=1) + "\n")

    write_folder_atomic(out_dir, fill)
    diffs, record = results["diffs"], results["record"]
    log.info("wrote %s: %s checked in ONNX Runtime, max |diff| %s", out_dir, ONNX_FILE, diffs)
    return record


def text_to_image_modules(model: str) -> tuple[Any, dict[str, nn.Module]]:
    """The fp32 CPU components of text-to-image ``model`` and the three modules exported from them: "text_encoder"
    (input_ids -> last_hidden_state), "unet" and "vae_decoder" (latents -> ``vae.decode(latents /
    scaling_factor)``, the decode of ``TextToImagePipeline``)."""
    import torch
    from torch import nn

    from fastdiff.models.stable_diffusion import load_stable_diffusion

    parts = load_stable_diffusion(model, device="cpu", dtype=torch.float32)
    if getattr(parts.text_encoder.config, "use_attention_mask", False):
        raise FastdiffError(f"{model}: a text encoder that reads an attention mask is not supported by the export")

    class TextEncoder(nn.Module):
        def __init__(self, encoder: nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.encoder(input_ids)[0]

    class VaeDecoder(nn.Module):
        def __init__(self, vae: nn.Module) -> None:
            super().__init__()
            self.vae = vae
            self.scaling_factor = float(vae.config.scaling_factor)

        def forward(self, latents: torch.Tensor) -> torch.Tensor:
            return self.vae.decode(latents / self.scaling_factor)

    modules = {
        "text_encoder": TextEncoder(parts.text_encoder).eval(),
        "unet": parts.unet.eval(),
        "vae_decoder": VaeDecoder(parts.vae).eval(),
    }
    return parts, modules


def text_to_image_inputs(parts: Any, timestep_dtype: str) -> dict[str, Callable[[int, int], dict[str, torch.Tensor]]]:
    """Per graph, ``make_inputs(batch, seed)`` -> seeded example inputs by name (token ids in the vocabulary, unit
    normal latents and text states, timesteps as in ``example_inputs``)."""
    import torch

    unet_cfg, vae_cfg = parts.unet.config, parts.vae.config
    size = unet_cfg.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    tokens = parts.tokenizer.model_max_length
    vocab = parts.text_encoder.config.vocab_size

    def text(batch: int, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(0, vocab, (batch, tokens), generator=gen, dtype=torch.int64)}

    def unet(batch: int, seed: int) -> dict[str, torch.Tensor]:
        sample, timestep = example_inputs(parts.unet, batch, seed, timestep_dtype)
        gen = torch.Generator().manual_seed(seed + 1000)
        states = torch.randn(batch, tokens, unet_cfg.cross_attention_dim, generator=gen)
        return {"sample": sample, "timestep": timestep, "encoder_hidden_states": states}

    def vae(batch: int, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"latents": torch.randn(batch, vae_cfg.latent_channels, height, width, generator=gen)}

    return {"text_encoder": text, "unet": unet, "vae_decoder": vae}


TEXT_TO_IMAGE_GRAPHS = {
    "text_encoder": (TEXT_ENCODER_FILE, ("input_ids",), ("last_hidden_state",)),
    "unet": (ONNX_FILE, ("sample", "timestep", "encoder_hidden_states"), OUTPUT_NAMES),
    "vae_decoder": (VAE_DECODER_FILE, ("latents",), ("image",)),
}
"""Graph -> (file, input names, output names)."""


def graph_tolerances() -> dict[str, float]:
    """Each text-to-image graph's tolerance (read when called, so a test may change the constants)."""
    return {"text_encoder": TEXT_TOLERANCE, "unet": TOLERANCE, "vae_decoder": VAE_TOLERANCE}


def text_to_image_description(
    model: str, parts: Any, opset: int, diffs: dict[str, dict[str, float]], timestep_dtype: str
) -> dict:
    """The ``model.json`` record of a text-to-image export: each graph's inputs, outputs and check, the tokenizer,
    the VAE scaling and the scheduler config."""
    import onnxruntime as ort
    import torch

    unet_cfg, vae_cfg = parts.unet.config, parts.vae.config
    size = unet_cfg.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    scale = 2 ** (len(vae_cfg.block_out_channels) - 1)
    tokens, hidden = parts.tokenizer.model_max_length, parts.text_encoder.config.hidden_size
    latents = ["batch", unet_cfg.in_channels, height, width]
    tolerances = graph_tolerances()
    specs = {
        "text_encoder": {
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", tokens]}],
            "outputs": [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", tokens, hidden]}],
            "about": "CLIPTextModel(input_ids).last_hidden_state: the text states the U-Net reads",
        },
        "unet": {
            "inputs": [
                {"name": "sample", "dtype": "float32", "shape": latents},
                {"name": "timestep", "dtype": timestep_dtype, "shape": ["batch"]},
                {"name": "encoder_hidden_states", "dtype": "float32", "shape": ["batch", tokens, hidden]},
            ],
            "outputs": [{"name": "model_output", "dtype": "float32", "shape": ["batch", *latents[1:]]}],
            "about": f"the U-Net's {parts.scheduler_config.get('prediction_type', 'epsilon')} prediction",
        },
        "vae_decoder": {
            "inputs": [{"name": "latents", "dtype": "float32", "shape": latents}],
            "outputs": [
                {
                    "name": "image",
                    "dtype": "float32",
                    "shape": ["batch", vae_cfg.out_channels, height * scale, width * scale],
                }
            ],
            "about": "input: the sampler's final latents as the U-Net sees them (scaled by scaling_factor); the "
            "graph computes vae.decode(latents / scaling_factor); output about [-1, 1], unclamped: pixels in "
            "[0, 1] are clip(image / 2 + 0.5, 0, 1)",
        },
    }
    graphs = {
        name: {
            "file": TEXT_TO_IMAGE_GRAPHS[name][0],
            **spec,
            "check": {"max_abs_diff": diffs[name], "tolerance": tolerances[name]},
        }
        for name, spec in specs.items()
    }
    return {
        "format": "onnx",
        "kind": "text-to-image",
        "model": model,
        "opset": opset,
        "graphs": graphs,
        "tokenizer": {
            "folder": "tokenizer",
            "class": type(parts.tokenizer).__name__,
            "padding": "max_length",
            "max_length": tokens,
            "truncation": True,
        },
        "vae_scaling_factor": float(vae_cfg.scaling_factor),
        "vae_scale_factor": scale,
        "guidance": "classifier-free, when the scale g > 1: the U-Net on [x; x] against [uncond; cond] text states "
        '(uncond: the encoded negative prompt, default ""), output = uncond + g * (cond - uncond)',
        "init_noise": "x_T = init_noise_sigma * unit normal latents (1 for DDIM)",
        "scheduler_config": parts.scheduler_config,
        "check": {
            "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
            "reference": "eager fp32",
            "batches": list(CHECK_BATCHES),
        },
        "torch": torch.__version__,
    }


def export_text_to_image(model: str, out_dir: Path, opset: int, timestep_dtype: str = "float32") -> dict:
    """Export text-to-image ``model``'s text encoder, U-Net and VAE decoder (each checked in ONNX Runtime) with its
    tokenizer and scheduler folders into ``out_dir`` (all or nothing); returns the ``model.json`` record."""
    from fastdiff.models.stable_diffusion import resolve_pipeline_dir

    root = resolve_pipeline_dir(model)
    parts, modules = text_to_image_modules(model)
    makers = text_to_image_inputs(parts, timestep_dtype)
    tolerances = graph_tolerances()
    results: dict = {}

    def fill(staging: Path) -> None:
        diffs = {}
        for name, (file, inputs, outputs) in TEXT_TO_IMAGE_GRAPHS.items():
            example = tuple(makers[name](TRACE_BATCH, 0).values())
            trace_onnx(modules[name], example, staging / file, opset, inputs, outputs)
            diffs[name] = check_graph(
                modules[name], staging / file, makers[name], CHECK_BATCHES, tolerances[name], name
            )
        for folder in COPIED_FOLDERS:
            shutil.copytree(root / folder, staging / folder)
        results["record"] = record = text_to_image_description(model, parts, opset, diffs, timestep_dtype)
        (staging / INFO_FILE).write_text(json.dumps(record, indent=1) + "\n")

    write_folder_atomic(out_dir, fill)
    diffs = {name: graph["check"]["max_abs_diff"] for name, graph in results["record"]["graphs"].items()}
    log.info("wrote %s: 3 graphs checked in ONNX Runtime, max |diff| %s", out_dir, diffs)
    return results["record"]


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
        f"into --out ({ONNX_FILE} + {INFO_FILE}). A text-to-image model (fashion-mnist-t2i or a diffusers "
        f"pipeline directory) gives {TEXT_ENCODER_FILE}, {ONNX_FILE} (with encoder_hidden_states; float32 "
        f"timestep) and {VAE_DECODER_FILE} (the sampler's latents -> image), plus its tokenizer/ and scheduler/. "
        f"ONNX Runtime (CPU) must match eager fp32 within {TOLERANCE:g} (each graph's tolerance: see {INFO_FILE}) "
        f"at batch sizes {', '.join(map(str, CHECK_BATCHES))}, else nothing is written."
    )
    p.add_argument("--format", default="onnx", choices=FORMATS, help="export format")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or model directory")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--opset", type=positive_int, default=OPSET, help="ONNX opset version")
    p.add_argument(
        "--timestep-dtype",
        default=None,
        choices=TIMESTEP_DTYPES,
        help="dtype of the U-Net's timestep input (default: int64 for an unconditional model, as before; float32 "
        "for a text-to-image model); float32 serves every sampler, including those with fractional timesteps",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    export_onnx(args.model, args.out, opset=args.opset, overwrite=args.overwrite, timestep_dtype=args.timestep_dtype)
    return 0
