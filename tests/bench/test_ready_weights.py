"""benchmarks/ready.py's weights for Stable Diffusion presets: written once as a diffusers directory, then read by
every timed run (the load a user with a checkpoint meets), instead of each run initialising random weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sd_presets_are_written_once_and_other_models_pass_through(tmp_path, monkeypatch):
    ready = load_script("ready")
    serve_reference = load_script("serve_reference")
    writes = []

    def fake_write(root: Path, preset: str = "sd15", **kwargs) -> Path:
        writes.append((root, preset))
        root.mkdir(parents=True)
        (root / "model_index.json").write_text("{}")
        return root

    monkeypatch.setattr(serve_reference, "write_random_sd", fake_write)
    monkeypatch.setitem(sys.modules, "serve_reference", serve_reference)
    monkeypatch.chdir(tmp_path)  # no file or folder named like a preset here
    assert ready.saved_preset("ddpm-cifar10", tmp_path) == ("ddpm-cifar10", None)
    model, how = ready.saved_preset("sd21", tmp_path / "w")
    assert model == str(tmp_path / "w" / "sd21") and writes == [(tmp_path / "w" / "sd21", "sd21")]
    assert "written once" in how
    assert ready.saved_preset("sd21", tmp_path / "w")[0] == model and len(writes) == 1  # reused, not rewritten


def test_runs_get_a_primed_bytecode_cache_of_their_own_unless_asked_not_to(monkeypatch):
    """A machine that sets PYTHONDONTWRITEBYTECODE compiles torch's and fastdiff's source in every process (~3 s on
    the lent H100s): by default the runs get a bytecode folder of their own, primed by one import, as a pip install
    has; ``as-set`` keeps the environment."""
    import os

    ready = load_script("ready")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert ready.bytecode_env("as-set")["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "not written" in ready.describe_bytecode("as-set")
    env = ready.bytecode_env("cached")
    assert "PYTHONDONTWRITEBYTECODE" not in env
    prefix = Path(env["PYTHONPYCACHEPREFIX"])
    cached = {p.name.split(".")[0] for p in prefix.rglob("*.pyc")}
    assert {"executor", "weights", "text_to_image"} <= cached  # fastdiff's engine and pipelines, primed
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # this process's environment is left alone
