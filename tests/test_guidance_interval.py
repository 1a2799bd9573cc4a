"""Guidance in an interval of the steps (``guidance_interval``) against diffusers' ``ClassifierFreeGuidance`` guider
(its ``start``/``stop``), on the bundled fashion-mnist-t2i model's real weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.samplers import SAMPLER_SCHEDULERS, ScheduleConfig, make_sampler
from fastdiff.samplers.sampler import guidance_steps

TOL = 1e-3  # max abs difference on [0, 1] images, fp32 on the CPU
STEPS = 8
GUIDANCE = 3.0
PROMPTS = ["a photo of a sneaker", "a dress"]
NEGATIVES = ["", "a bag"]


@pytest.mark.parametrize(
    ("interval", "steps", "expected"),
    [((0.0, 1.0), 20, (0, 20)), ((0.2, 0.8), 20, (4, 16)), ((0.25, 0.75), 7, (1, 5)), ((0.5, 0.5), 10, (5, 5))],
)
def test_guided_steps_are_diffusers_int_fractions(interval, steps, expected):
    assert guidance_steps(interval, steps) == expected


@pytest.mark.parametrize("interval", [(1.0, 1.0), (0.5, 0.4), (-0.1, 1.0), (0.0, 1.2), (0.1,), "ab", None])
def test_bad_intervals_are_one_line_errors(interval):
    with pytest.raises(FastdiffError, match="guidance interval"):
        make_sampler("ddim", ScheduleConfig(), 10, guidance_interval=interval)


def test_the_switch_column_marks_the_guided_steps():
    sampler = make_sampler("unipc", ScheduleConfig(), 10, guidance_interval=(0.3, 0.65))
    switch = sampler.coefs[:, -1].tolist()
    assert switch == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert make_sampler("unipc", ScheduleConfig(), 10).coefs[:, -1].tolist() == [1] * 10


def guider_loop(pipe, scheduler, prompts, negatives, latents, interval):
    """diffusers' denoising loop with its ClassifierFreeGuidance guider: the unconditional U-Net call only at the
    steps the guider enables, then the pipeline's own decode and post-processing."""
    from diffusers.guiders import ClassifierFreeGuidance

    guider = ClassifierFreeGuidance(guidance_scale=GUIDANCE, start=interval[0], stop=interval[1])
    cond, uncond = pipe.encode_prompt(prompts, "cpu", 1, True, negative_prompt=negatives)
    scheduler.set_timesteps(STEPS)
    x = latents * scheduler.init_noise_sigma
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            guider.set_state(step=i, num_inference_steps=STEPS, timestep=t)
            model_input = scheduler.scale_model_input(x, t)
            pred_cond = pipe.unet(model_input, t, encoder_hidden_states=cond).sample
            pred_uncond = None
            if guider.num_conditions == 2:
                pred_uncond = pipe.unet(model_input, t, encoder_hidden_states=uncond).sample
            x = scheduler.step(guider.forward(pred_cond, pred_uncond).pred, t, x).prev_sample
        image = pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample
    return pipe.image_processor.postprocess(image, output_type="np")


@pytest.mark.parametrize("sampler", ["ddim", "dpmsolver++"])
def test_interval_guidance_matches_the_diffusers_guider(sampler):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from fastdiff.models.stable_diffusion import BUNDLED_PIPELINES
    from fastdiff.pipelines.text_to_image import TextToImagePipeline

    root = BUNDLED_PIPELINES["fashion-mnist-t2i"]
    reference = diffusers.StableDiffusionPipeline.from_pretrained(root, torch_dtype=torch.float32)
    scheduler = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_pretrained(root, subfolder="scheduler")
    ours = TextToImagePipeline.from_pretrained(root, device="cpu", steps=STEPS)
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    kwargs = dict(negative_prompt=NEGATIVES, guidance_scale=GUIDANCE, output_type="np", progress=False)
    images = {}
    for interval in [(0.25, 0.75), (0.0, 1.0)]:
        theirs = guider_loop(reference, scheduler, PROMPTS, NEGATIVES, latents.clone(), interval)
        images[interval] = ours(PROMPTS, sampler=sampler, latents=latents, guidance_interval=interval, **kwargs)
        assert images[interval].shape == theirs.shape == (2, 32, 32, 1)
        assert float(np.abs(images[interval] - theirs).max()) <= TOL, interval
    assert float(np.abs(images[(0.25, 0.75)] - images[(0.0, 1.0)]).max()) > 10 * TOL  # the interval matters
