"""Per-step noise is drawn when a step needs it: memory does not grow with the number of steps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastdiff.samplers import initial_noise, seed_tensor, step_noise

PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig
    from fastdiff.pipelines import Pipeline
    from fastdiff.samplers import ScheduleConfig
    torch.set_num_threads(1)
    config = DDPMUNetConfig(sample_size=128, in_channels=3, out_channels=3, block_out_channels=(4,),
                            layers_per_block=1, down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",),
                            norm_num_groups=4, add_attention=False)  # attention at 128x128 would dominate
    unet = DDPMUNet(config).eval()
    steps = int(sys.argv[1])
    pipe = Pipeline(unet, ScheduleConfig(), sampler="ddpm", steps=steps, backend="eager")
    images = pipe(batch_size=8, seeds=0, output_type="tensor", progress=False)
    assert torch.isfinite(images).all()
    # VmHWM: this process's own peak RSS (ru_maxrss would include the parent's peak, inherited at fork)
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_mb": int(hwm.split()[1]) / 1024}))
    """
)


def peak_rss_mb(steps: int) -> float:
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(steps)], capture_output=True, text=True,
                            check=True, timeout=900)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss_mb"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from Linux's /proc")
def test_ddpm_1000_steps_128px_batch8_stays_under_1_2_gb():
    """The issue's case: drawing all noise up front took 3.4 GB here (8 x 1000 x 3 x 128 x 128 floats = 1.5 GB
    of noise alone, plus the copies); per-step draws keep the peak flat in the number of steps."""
    peak_1000 = peak_rss_mb(1000)
    assert peak_1000 < 1200, f"peak RSS {peak_1000:.0f} MB"
    peak_10 = peak_rss_mb(10)
    assert peak_1000 < peak_10 + 100, f"{peak_10:.0f} MB at 10 steps, {peak_1000:.0f} MB at 1000"


def test_celebahq_preset_first_step_allocates_no_noise_for_all_steps(monkeypatch):
    """ddpm-celebahq-256 at batch 4, DDPM 1000 steps: at the first model call only x_T exists (all-step noise
    would be 4 x 1000 x 3 x 256 x 256 floats = 3.1 GB)."""
    from fastdiff.pipelines import Pipeline

    pipe = Pipeline.from_pretrained("ddpm-celebahq-256", device="cpu", sampler="ddpm", steps=1000)
    seen = {}

    class FirstStep(Exception):
        pass

    def first_call(x, t):
        seen["tensors"] = [o for o in __import__("gc").get_objects() if isinstance(o, torch.Tensor)]
        raise FirstStep

    monkeypatch.setattr(pipe.unet, "forward", first_call)
    with pytest.raises(FirstStep):
        pipe(batch_size=4, seeds=0, progress=False)
    biggest = max(t.numel() for t in seen["tensors"] if not isinstance(t, torch.nn.Parameter))
    assert biggest <= 4 * 3 * 256 * 256 * 4  # nothing near 1000 steps of noise (x_T, history: a few images)


def test_step_noise_depends_on_seed_and_step_only():
    seeds = seed_tensor([7, 8, 9], "cpu")
    noise = step_noise(seeds, 5, (2, 3, 4))
    assert torch.equal(step_noise(seeds[1:], 5, (2, 3, 4)), noise[1:])
    assert not torch.equal(step_noise(seeds, 6, (2, 3, 4)), noise)
    assert not torch.equal(initial_noise(seeds, (2, 3, 4), "cpu"), noise)


@pytest.mark.parametrize("seeds", [[-1], [2**63], [1.5], [True], torch.tensor([0.5]), torch.tensor([-3])])
def test_bad_seeds_are_one_line_errors(seeds):
    from fastdiff.errors import FastdiffError

    with pytest.raises(FastdiffError, match="seeds must be"):
        seed_tensor(seeds, "cpu")
