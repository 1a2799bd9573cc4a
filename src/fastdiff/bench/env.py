"""What every result records: GPU, driver, library versions, git sha, date, whether kernels launch with PDL."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from fastdiff.kernels.common import programmatic_launch


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    """HEAD's short sha; FASTDIFF_GIT_SHA wins (the GPU machine gets a copy of the tree without .git)."""
    if os.environ.get("FASTDIFF_GIT_SHA"):
        return os.environ["FASTDIFF_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' stays 'cpu'."""
    for word in name.lower().replace("-", " ").split():
        if word[:1] in "ahlbv" and any(ch.isdigit() for ch in word) and word != "80gb":
            return word
    return name.lower().split()[0]


def environment() -> dict:
    """GPU name, driver, CUDA, torch/triton/diffusers versions, git sha, date; CPU-only fields when no GPU."""
    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton") or package_version("pytorch-triton"),
        "diffusers": package_version("diffusers"),
        "cpu": platform.processor() or platform.machine(),
        "gpu": "cpu",
        "driver": None,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
        info["programmatic_launch"] = programmatic_launch(torch.device("cuda", 0))  # FASTDIFF_PDL
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing or not permitted: the driver stays unknown
            info["driver"] = None
    return info
