"""Rough edges a new user hit, each fixed at its source and pinned here (these run as root in CI, never skipped):

1. output locations are proven writable before any work (a probe file, not ``os.access``, which says yes to root
   everywhere): /proc and /sys targets fail at once, exit 2, one line, nothing written; sample's grid and
   per-image files are written together or not at all;
2. every flag is checked before any model loads (seeds, guidance, eta, ports, ...), the library refuses a
   negative guidance scale;
3. ``fastdiff --version``/``--help`` and the light commands' ``--help`` import no torch;
4. fp16/bf16 on the CPU is named as slow in one warning line.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fastdiff
import fastdiff.export
import fastdiff.generate
import fastdiff.quality.cli
import fastdiff.train.trainer
from fastdiff.cli import build_parser, main
from fastdiff.cli_args import (
    DTYPES,
    KARRAS_SAMPLERS,
    MAX_SEED,
    SAMPLER_SCHEDULERS,
    SAMPLERS,
    finite_nonnegative_float,
    seed_int,
)
from fastdiff.errors import FastdiffError
from fastdiff.pipelines import DTYPE_NAMES, Pipeline, TextToImagePipeline

UNWRITABLE = ("/proc", "/sys")
"""Folders where nobody, root included, can create a file."""


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def run(argv: list[str]) -> int:
    """``main(argv)``; an argparse error (SystemExit) counts as its exit code."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any command gets as far as loading a model (or running its work)."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments and outputs were checked")

    monkeypatch.setattr(Pipeline, "from_pretrained", refuse)
    monkeypatch.setattr(TextToImagePipeline, "from_pretrained", refuse)
    monkeypatch.setattr(fastdiff.generate, "load_pipeline", refuse)
    monkeypatch.setattr(fastdiff.export, "load_fp32_unet", refuse)
    monkeypatch.setattr(fastdiff.quality.cli, "compute_fid", refuse)
    monkeypatch.setattr(fastdiff.train.trainer, "train", refuse)
    for module, name in [
        ("fastdiff.bench.runner", "run_bench"),
        ("fastdiff.profile.report", "run_profile"),
        ("fastdiff.serve.loadtest", "run_loadtest"),
        ("fastdiff.train.text_to_image", "train_vae"),
    ]:
        try:
            monkeypatch.setattr(f"{module}.{name}", refuse)
        except ImportError:  # an optional part (fastapi for loadtest) that is not installed
            pass


# --- 1. outputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("root", UNWRITABLE)
@pytest.mark.parametrize("bad", ["--out", "--save-dir"])
def test_sample_refuses_an_unwritable_output_before_any_work(tmp_path, capsys, no_loading, root, bad):
    """Either output in /proc or /sys: exit 2, one line naming it, and the other output is not written either."""
    target = f"{root}/fastdiff-x.png" if bad == "--out" else f"{root}/fastdiff-sd"
    outputs = {"--out": str(tmp_path / "grid.png"), "--save-dir": str(tmp_path / "each"), bad: target}
    argv = ["sample", "--steps", "1", "--batch", "1", "--device", "cpu", *(x for kv in outputs.items() for x in kv)]
    assert run(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"fastdiff: error: {bad} {target}: cannot write in {root}"), lines
    assert os.listdir(tmp_path) == [] and not os.path.exists(target)


def output_cases(tmp_path: Path, root: str) -> list[tuple[list[str], str]]:
    """(argv, flag) of every command with an output, that output in ``root``."""
    t = str(tmp_path)
    return [
        (["generate", "--model", "fashion-mnist", "--num-images", "1", "--out-dir", f"{root}/g"], "--out-dir"),
        (["export", "--out", f"{root}/e"], "--out"),
        (["bench", "--device", "cpu", "--out-dir", f"{root}/b"], "--out-dir"),
        (["profile", "--device", "cpu", "--out", f"{root}/p"], "--out"),
        (["fid", t, "--json", f"{root}/f.json"], "--json"),
        (["train", "--out", f"{root}/t"], "--out"),
        (["train", "--out", f"{t}/run", "--export", f"{root}/e"], "--export"),
        (["train", "text-to-image", "--stage", "vae", "--out", f"{root}/t"], "--out"),
        (["loadtest", "--url", "http://127.0.0.1:9", "--out", f"{root}/l.json"], "--out"),
    ]


@pytest.mark.parametrize("root", UNWRITABLE)
@pytest.mark.parametrize("command", ["generate", "export", "bench", "profile", "fid", "train", "train-export",
                                     "train-t2i", "loadtest"])  # fmt: skip
def test_every_command_refuses_an_unwritable_output_before_any_work(tmp_path, capsys, no_loading, root, command):
    names = ["generate", "export", "bench", "profile", "fid", "train", "train-export", "train-t2i", "loadtest"]
    argv, flag = output_cases(tmp_path, root)[names.index(command)]
    assert run(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"fastdiff: error: {flag} {root}/"), lines
    assert f"cannot write in {root}" in lines[0], lines
    assert os.listdir(tmp_path) == []


def test_sample_writes_grid_and_images_together_or_not_at_all(tmp_path, capsys):
    """A per-image file that cannot be committed (a folder holds its name) undoes the ones before it: no grid,
    no images, no temporary files; the command says so in one line."""
    each = tmp_path / "each"
    (each / "000001.png").mkdir(parents=True)  # seed 1's file cannot replace a folder
    grid = tmp_path / "grid.png"
    argv = ["sample", "--steps", "1", "--batch", "2", "--device", "cpu", "--out", str(grid), "--save-dir", str(each),
            "--no-progress"]  # fmt: skip
    assert run(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("fastdiff: error: nothing written: cannot write"), lines
    assert sorted(os.listdir(tmp_path)) == ["each"] and os.listdir(each) == ["000001.png"]
    assert (each / "000001.png").is_dir() and not list((each / "000001.png").iterdir())


# --- 2. flags ---------------------------------------------------------------------------------------------------

T2I = ["sample", "--model", "fashion-mnist-t2i", "--prompt", "sneaker", "--steps", "1", "--device", "cpu"]
BAD_FLAGS = [
    (["sample", "--seed", "-1"], "argument --seed: must be in 0..9223372036854775807"),
    (["sample", "--seed", "1.5"], "argument --seed: '1.5' is not an integer"),
    (["sample", "--seed", str(2**63)], "argument --seed: must be in 0.."),
    (["sample", "--seed", str(MAX_SEED), "--batch", "2"], "goes past the largest seed"),
    ([*T2I, "--guidance", "-1"], "argument --guidance: must be >= 0, got -1"),
    ([*T2I, "--guidance", "nan"], "argument --guidance: must be a finite number, got nan"),
    ([*T2I, "--guidance", "inf"], "argument --guidance: must be a finite number, got inf"),
    ([*T2I, "--guidance", "lots"], "argument --guidance: 'lots' is not a number"),
    (["sample", "--eta", "nan"], "argument --eta: must be a finite number"),
    (["sample", "--eta", "-0.5"], "argument --eta: must be >= 0"),
    (["generate", "--model", "fashion-mnist", "--num-images", "1", "--out-dir", "{tmp}/g", "--first-seed", "-1"],
     "argument --first-seed: must be in 0.."),
    (["generate", "--model", "fashion-mnist", "--num-images", "2", "--out-dir", "{tmp}/g", "--first-seed",
      str(MAX_SEED)], "seeds must be in 0.."),
    (["generate", "--model", "fashion-mnist", "--num-images", "1", "--out-dir", "{tmp}/g", "--timeout", "nan"],
     "argument --timeout: must be a finite number"),
    (["bench", "--device", "cpu", "--out-dir", "{tmp}/b", "--seed", "-1"], "argument --seed: must be in 0.."),
    (["bench", "--device", "cpu", "--out-dir", "{tmp}/b", "--batch", "0"], "argument --batch: must be positive"),
    (["bench", "--device", "cpu", "--out-dir", "{tmp}/b", "--sampler", "nope"], "argument --sampler: invalid choice"),
    (["profile", "--device", "cpu", "--out", "{tmp}/p", "--seed", "-1"], "argument --seed: must be in 0.."),
    (["profile", "--device", "cpu", "--out", "{tmp}/p", "--top", "0"], "argument --top: must be positive"),
    (["profile", "--device", "cpu", "--out", "{tmp}/p", "--energy-seconds", "-1"], "argument --energy-seconds: must"),
    (["serve", "--port", "70000"], "argument --port: must be a TCP port in 0..65535"),
    (["serve", "--max-wait-ms", "nan"], "argument --max-wait-ms: must be a finite number"),
    (["loadtest", "--seed", "-3"], "argument --seed: must be in 0.."),
    (["loadtest", "--timeout", "0"], "argument --timeout: must be positive"),
    (["train", "--out", "{tmp}/t", "--seed", "-1"], "argument --seed: must be in 0.."),
    (["train", "--out", "{tmp}/t", "--lr", "nan"], "argument --lr: must be a finite number"),
    (["train", "text-to-image", "--stage", "vae", "--out", "{tmp}/t", "--seed", "-1"], "argument --seed: must be"),
    (["export", "--out", "{tmp}/e", "--opset", "0"], "argument --opset: must be positive"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_FLAGS])
def test_bad_flags_are_refused_before_any_model_loads(tmp_path, capsys, no_loading, argv, message):
    start = time.perf_counter()
    assert run([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith(("fastdiff: error:", f"fastdiff {argv[0]}")), lines
    assert os.listdir(tmp_path) == []
    assert time.perf_counter() - start < 60  # no model load (no_loading), no sampling: seconds at most


def test_export_refuses_an_opset_torch_cannot_write_before_loading(tmp_path, capsys, no_loading):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    assert run(["export", "--out", str(tmp_path / "e"), "--opset", "99"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "--opset must be in 7.." in lines[0] and "got 99" in lines[0], lines


def test_guidance_from_zero_up_is_accepted():
    """diffusers turns guidance on above 1 and runs the conditional model alone at 1 or less, 0 included."""
    for text in ("0", "0.5", "1", "7.5", "1e3"):
        assert finite_nonnegative_float(text) == float(text)
    args = build_parser().parse_args(["sample", "--guidance", "0", "--seed", str(MAX_SEED)])
    assert args.guidance == 0.0 and args.seed == MAX_SEED
    for text in ("-1", "-0.1", "nan", "-inf", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            finite_nonnegative_float(text)
    with pytest.raises(argparse.ArgumentTypeError):
        seed_int("-1")


@pytest.fixture(scope="module")
def t2i_pipe():
    return Pipeline.from_pretrained("fashion-mnist-t2i", device="cpu", steps=1)


@pytest.mark.parametrize("scale", [-1, -0.5, float("nan"), float("inf"), True, "7"])
def test_library_refuses_a_bad_guidance_scale_in_one_line(t2i_pipe, scale):
    with pytest.raises(FastdiffError) as info:
        t2i_pipe("sneaker", guidance_scale=scale, seeds=0, progress=False)
    assert "guidance_scale must be a finite number >= 0" in str(info.value) and "\n" not in str(info.value)


def test_library_runs_guidance_below_one_without_guidance(t2i_pipe):
    """0 <= guidance_scale <= 1 is the conditional model alone, the same image whatever the scale there."""
    zero = t2i_pipe("sneaker", guidance_scale=0, seeds=3, output_type="tensor", progress=False)
    one = t2i_pipe("sneaker", guidance_scale=1.0, seeds=3, output_type="tensor", progress=False)
    assert zero.shape == one.shape and bool((zero == one).all())


def test_cli_choices_match_the_library():
    """cli_args copies these names so that building the parser imports no torch: the copies must not drift."""
    from fastdiff import samplers

    assert SAMPLERS == samplers.SAMPLERS and KARRAS_SAMPLERS == samplers.KARRAS_SAMPLERS
    assert SAMPLER_SCHEDULERS == samplers.SAMPLER_SCHEDULERS
    assert set(DTYPES) == set(DTYPE_NAMES)
    assert MAX_SEED == samplers.noise.MAX_SEED


# --- 3. fast --help and --version -------------------------------------------------------------------------------

LIGHT = [["--version"], ["--help"], ["sample", "--help"], ["generate", "--help"], ["serve", "--help"],
         ["loadtest", "--help"], ["export", "--help"]]  # fmt: skip
HEAVY = ("torch", "numpy", "diffusers", "transformers", "fastapi", "triton")

PROBE = """
import sys
from fastdiff.cli import main
for argv in {argv!r}:
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
import fastdiff
print(sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


def test_help_and_version_import_no_torch():
    """``fastdiff --version``, ``--help`` and the light commands' ``--help`` import none of torch, numpy,
    diffusers, transformers, fastapi or triton (the commands load them when they run)."""
    code = PROBE.format(argv=LIGHT, heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr


def seconds(*argv: str) -> float:
    """The fastest of three runs of ``python ARGV`` (each must succeed)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], capture_output=True, timeout=120, check=True)
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.slow
def test_version_and_help_answer_at_once():
    """Against this machine's own torch import, so that a slow machine does not flake and a fast one still sees
    torch come back: ~0.05 s here for each, ~1 s for ``import torch``."""
    torch_import = seconds("-c", "import torch")
    for argv in (["--version"], ["--help"]):
        took = seconds("-m", "fastdiff.cli", *argv)
        assert took < 0.5 * torch_import, (argv, took, torch_import)


def test_package_exposes_the_api_lazily():
    code = "import sys, fastdiff; assert 'torch' not in sys.modules; print(fastdiff.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == fastdiff.__version__, proc.stderr
    from fastdiff.models import load_unet

    assert fastdiff.Pipeline is Pipeline and fastdiff.TextToImagePipeline is TextToImagePipeline
    assert fastdiff.load_unet is load_unet and fastdiff.FastdiffError is FastdiffError
    assert {"Pipeline", "load_unet"} <= set(dir(fastdiff))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastdiff.nope  # noqa: B018


def test_every_command_gets_its_flags_when_used():
    """Each command's flags are added on first use; a completed parser has them all (and their help)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {
        "sample",
        "generate",
        "train",
        "fid",
        "bench",
        "profile",
        "serve",
        "loadtest",
        "tune",
        "export",
    }
    assert [a.dest for a in commands["generate"]._actions] == ["help"]  # nothing imported yet
    args = parser.parse_args(["generate", "--model", "m", "--num-images", "2", "--out-dir", "o"])
    assert args.func is fastdiff.generate.run_generate and args.first_seed == 0
    assert "--first-seed" in commands["generate"].format_help()


# --- 4. fp16/bf16 on the CPU --------------------------------------------------------------------------------


def slow_warnings(caplog) -> list[str]:
    """The slow-dtype warnings logged, each as "LOGGER: MESSAGE"."""
    records = [r for r in caplog.records if r.levelno == logging.WARNING and "CPU is slow" in r.getMessage()]
    return [f"{r.name}: {r.getMessage()}" for r in records]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_on_the_cpu_warns_once(caplog, dtype):
    """The run goes on in the dtype asked for (a warning, not a silent switch to fp32)."""
    import torch

    with caplog.at_level(logging.WARNING, logger="fastdiff"):
        pipe = Pipeline.from_pretrained("fashion-mnist", device="cpu", dtype=dtype, steps=1)
    assert slow_warnings(caplog) == [
        f"fastdiff.devices: {dtype} on the CPU is slow (many times slower than fp32, the CPU's fast path): use "
        "dtype fp32 there"
    ]
    assert pipe.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdiff"):
        Pipeline.from_pretrained("fashion-mnist", device="cpu", dtype="fp32", steps=1)
    assert slow_warnings(caplog) == []


def test_text_to_image_half_precision_on_the_cpu_warns_before_loading(caplog, monkeypatch):
    import fastdiff.pipelines.text_to_image as t2i

    def stop(*args, **kwargs):
        raise RuntimeError("loading")

    monkeypatch.setattr(t2i, "load_stable_diffusion", stop)
    with caplog.at_level(logging.WARNING, logger="fastdiff"), pytest.raises(RuntimeError, match="loading"):
        Pipeline.from_pretrained("fashion-mnist-t2i", device="cpu", dtype="bf16")
    assert len(slow_warnings(caplog)) == 1 and slow_warnings(caplog)[0].startswith("fastdiff.devices: bf16 on the")


def test_cli_prints_the_warning_in_one_line(tmp_path):
    argv = ["sample", "--dtype", "fp16", "--device", "cpu", "--steps", "1", "--batch", "1", "--out",
            str(tmp_path / "g.png"), "--no-progress"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "fastdiff.cli", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "CPU is slow" in line]
    assert warnings == ["WARNING fastdiff.devices: fp16 on the CPU is slow (many times slower than fp32, the CPU's "
                        "fast path): use dtype fp32 there"], proc.stderr  # fmt: skip
    assert (tmp_path / "g.png").is_file()


def test_dtype_auto_is_fp16_on_a_gpu_and_fp32_on_the_cpu(monkeypatch):
    """--dtype auto (the sampling commands' default) resolves by --device; "auto" asks torch for a GPU."""
    import torch

    from fastdiff.cli_args import resolve_dtype_choice

    assert resolve_dtype_choice("auto", "cpu") == "fp32"
    assert resolve_dtype_choice("auto", "cuda:1") == resolve_dtype_choice("auto", "cuda") == "fp16"
    assert resolve_dtype_choice("bf16", "cuda") == "bf16" and resolve_dtype_choice("fp16", "cpu") == "fp16"
    for available, expected in ((True, "fp16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert resolve_dtype_choice("auto", "auto") == expected
