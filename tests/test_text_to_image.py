"""TextToImagePipeline on tiny SD 1.5 / 2.1 directories vs diffusers' StableDiffusionPipeline and
StableDiffusionImg2ImgPipeline (same latents, prompts and matching scheduler), one-line errors, and the CLI's PNGs
with their generation parameters."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from sd_fixtures import SD15_SCHEDULER_CONFIG, SD21_SCHEDULER_CONFIG, write_tiny_sd_pipeline

import fastdiff
import fastdiff.pipelines.text_to_image as t2i
from fastdiff.cli import main
from fastdiff.errors import FastdiffError
from fastdiff.models.unet_2d_condition import UNet2DConditionModel
from fastdiff.pipelines.text_to_image import TextToImagePipeline
from fastdiff.samplers import SAMPLER_SCHEDULERS

TOL = 1e-3  # max abs diff on [0, 1] output images, fp32
STEPS = 5
SIZE = 64  # the tiny U-Nets' sample_size 8 x 8: latents 4 x 8 x 8
PROMPTS = ["a cat on the mat", "the thing of ca"]
NEGATIVES = ["ugly", ""]
OUTPUT_SCALE = 0.1
"""The tiny U-Nets' output layer is scaled by this. A random U-Net does not predict the noise, so the x0 estimate
at high noise amplifies its error ~15x per step, and guidance 7.5 amplifies again: with the default init, diffusers
run twice on latents differing by 1e-6 (relative) gives images up to 6e-3 apart, so float rounding alone would
exceed TOL. Scaled, that figure is <= 1e-4 while swapping the two prompts still moves the images by > 2e-2."""


def tiny_pipeline(root, variant: str, seed: int):
    """(directory, diffusers pipeline): a tiny ``variant`` pipeline with its U-Net output scaled, saved at root."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    pipe = write_tiny_sd_pipeline(root, variant, seed=seed)
    with torch.no_grad():
        pipe.unet.conv_out.weight.mul_(OUTPUT_SCALE)
        pipe.unet.conv_out.bias.mul_(OUTPUT_SCALE)
    pipe.unet.save_pretrained(root / "unet")
    return root, pipe


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """Tiny SD 1.5: epsilon prediction; its scheduler config names PNDMScheduler, "leading" spacing."""
    return tiny_pipeline(tmp_path_factory.mktemp("t2i-sd15") / "pipeline", "sd15", seed=21)


@pytest.fixture(scope="module")
def sd21(tmp_path_factory):
    """Tiny SD 2.1: v-prediction, DDIMScheduler config."""
    return tiny_pipeline(tmp_path_factory.mktemp("t2i-sd21") / "pipeline", "sd21", seed=22)


@pytest.fixture(scope="module")
def fast(sd15, sd21):
    """variant -> TextToImagePipeline (fp32, CPU), loaded once."""
    return {
        name: TextToImagePipeline.from_pretrained(root, device="cpu", steps=STEPS)
        for name, (root, _) in (("sd15", sd15), ("sd21", sd21))
    }


def with_scheduler(root, pipe, sampler: str, img2img: bool = False):
    """diffusers' (img2img) pipeline on the same components with the scheduler fastdiff's ``sampler`` equals, read
    from the saved scheduler config as fastdiff reads it (the in-memory config still marks the keys SD's config
    lacks as defaults, so that e.g. Euler would take its own "linspace" spacing over the saved "leading")."""
    import diffusers

    scheduler = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_pretrained(root, subfolder="scheduler")
    cls = diffusers.StableDiffusionImg2ImgPipeline if img2img else diffusers.StableDiffusionPipeline
    other = cls(**{**pipe.components, "scheduler": scheduler})
    other.set_progress_bar_config(disable=True)
    return other


def max_abs(ours: np.ndarray, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape and np.isfinite(ours).all()
    return float(np.abs(ours - theirs).max())


@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmsolver++"])
@pytest.mark.parametrize("variant", ["sd15", "sd21"])
def test_text_to_image_matches_diffusers(variant, sampler, request, fast):
    root, pipe = request.getfixturevalue(variant)
    latents = torch.randn(2, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(1))
    kwargs = dict(negative_prompt=NEGATIVES, guidance_scale=7.5, output_type="np")
    reference = with_scheduler(root, pipe, sampler)
    expected = reference(PROMPTS, num_inference_steps=STEPS, latents=latents.clone(), **kwargs)
    ours = fast[variant](PROMPTS, sampler=sampler, latents=latents, progress=False, **kwargs)
    assert ours.dtype == np.float32 and ours.shape == (2, SIZE, SIZE, 3)
    assert max_abs(ours, expected.images) <= TOL


def test_without_guidance_matches_diffusers(sd15, fast):
    root, pipe = sd15
    latents = torch.randn(1, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(2))
    kwargs = dict(negative_prompt="ugly", guidance_scale=1.0, output_type="np")
    expected = with_scheduler(root, pipe, "ddim")("a cat", num_inference_steps=STEPS, latents=latents.clone(), **kwargs)
    ours = fast["sd15"]("a cat", latents=latents, progress=False, **kwargs)
    assert max_abs(ours, expected.images) <= TOL
    guided = fast["sd15"]("a cat", latents=latents, progress=False, **{**kwargs, "guidance_scale": 7.5})
    assert max_abs(guided, ours) > 5 * TOL  # guidance and the negative prompt matter at this scale


def init_image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmsolver++"])
@pytest.mark.parametrize("variant", ["sd15", "sd21"])
def test_img2img_matches_diffusers(variant, sampler, request, fast, monkeypatch):
    """diffusers draws, from each image's generator, the VAE posterior's noise and then the noise it adds at the
    start step: the same two draws are handed to fastdiff (posterior noise patched in, added noise as latents)."""
    root, pipe = request.getfixturevalue(variant)
    seeds = [5, 6]
    shape = (1, 4, SIZE // 8, SIZE // 8)
    draws = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        draws.append((torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)))
    posterior, added = (torch.cat(d) for d in zip(*draws, strict=True))
    monkeypatch.setattr(t2i, "posterior_noise", lambda seed_ids, latent_shape: posterior)
    image = init_image(3)
    kwargs = dict(negative_prompt=NEGATIVES, image=image, strength=0.6, output_type="np")
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    expected = with_scheduler(root, pipe, sampler, img2img=True)(
        PROMPTS, num_inference_steps=STEPS, generator=generators, **kwargs
    )
    ours = fast[variant](PROMPTS, sampler=sampler, latents=added, progress=False, **kwargs)
    assert max_abs(ours, expected.images) <= TOL


def test_init_image_types_agree(fast):
    """A PIL image, its [0, 1] array and its [0, 1] tensor give the same images; one image serves every prompt."""
    pipe = fast["sd21"]
    image = init_image(7)
    array = np.asarray(image, dtype=np.float32) / 255
    kwargs = dict(seeds=[1, 2], steps=4, strength=0.5, output_type="np", progress=False)
    ours = pipe(PROMPTS, image=image, **kwargs)
    assert max_abs(pipe(PROMPTS, image=array[None], **kwargs), ours) <= 1e-6
    assert max_abs(pipe(PROMPTS, image=[image, image], **kwargs), ours) <= 1e-4  # encoded as a batch of 2
    assert max_abs(pipe(PROMPTS, image=torch.from_numpy(array).permute(2, 0, 1), **kwargs), ours) <= 1e-6


@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmsolver++", "unipc"])
@pytest.mark.parametrize("variant", ["sd15", "sd21"])
def test_img2img_loop_matches_the_scheduler(variant, sampler):
    """make_sampler(start=...) and noised_state equal the diffusers scheduler after set_begin_index and add_noise
    (then scale_model_input, step, ...) on a smooth stand-in model: the start level, the remaining timesteps and
    the multistep solvers' warm-up from an empty history."""
    import diffusers

    from fastdiff.samplers import ScheduleConfig, make_sampler

    saved = {"sd15": SD15_SCHEDULER_CONFIG, "sd21": SD21_SCHEDULER_CONFIG}[variant]
    steps, strength = 10, 0.6
    start = t2i.start_step(steps, strength)
    ours = make_sampler(sampler, ScheduleConfig.from_diffusers(saved), steps, start=start)
    assert start == 4 and ours.num_steps == 6
    scheduler = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_config(saved)
    scheduler.set_timesteps(steps)
    timesteps = scheduler.timesteps[start:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    torch.testing.assert_close(ours.timesteps, timesteps.float())

    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.tanh(x) + 0.1 * torch.cos(t / 100.0)

    generator = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 4, 3, 3, generator=generator), torch.randn(2, 4, 3, 3, generator=generator)
    expected = scheduler.add_noise(x0, noise, timesteps[:1])
    x = ours.noised_state(x0, noise)
    state = ours.new_state(x)
    for i, t in enumerate(timesteps):
        model_input = scheduler.scale_model_input(expected, t)
        torch.testing.assert_close(x, model_input, atol=1e-5, rtol=1e-5)
        expected = scheduler.step(model(model_input, t), t, expected).prev_sample
        x = ours.step(i, x, model(x, ours.timesteps[i]), state)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_image_depends_on_its_seed_only(fast):
    """Images are prompt-major (as diffusers orders them) and image b depends on its prompt and seeds[b] only."""
    pipe = fast["sd15"]
    kwargs = dict(output_type="pt", progress=False, steps=3, sampler="euler_a")
    four = pipe(PROMPTS, seeds=[3, 4, 5, 6], num_images_per_prompt=2, **kwargs)
    single = pipe(PROMPTS[1], seeds=5, **kwargs)
    torch.testing.assert_close(four[2:3], single, atol=1e-4, rtol=0)  # batch-size rounding only
    assert (four[2] - four[3]).abs().max() > 20 * TOL
    assert four.shape == (4, 3, SIZE, SIZE) and 0 <= four.min() and four.max() <= 1
    pil = pipe("a cat", seeds=4, progress=False, steps=2, height=32, width=48)
    assert len(pil) == 1 and pil[0].size == (48, 32)


def test_per_prompt_guidance_equals_separate_calls(fast):
    """guidance_scale as a list: each prompt's images as a call with that scale alone (the fused step takes a
    scale per row), so requests with different scales can share one batch."""
    pipe = fast["sd15"]
    kwargs = dict(output_type="pt", progress=False, steps=3, sampler="ddim", negative_prompt=["", "blurry"])
    both = pipe(PROMPTS, guidance_scale=[2.0, 9.0], seeds=[7, 8], **kwargs)
    low = pipe(PROMPTS, guidance_scale=2.0, seeds=[7, 8], **kwargs)
    high = pipe(PROMPTS, guidance_scale=9.0, seeds=[7, 8], **kwargs)
    torch.testing.assert_close(both[0], low[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1], high[1], atol=1e-5, rtol=0)
    assert (both[1] - low[1]).abs().max() > 20 * TOL  # the scale matters at this size


def test_text_states_are_cached_and_independent_of_company(fast, monkeypatch):
    """Each text is encoded alone and once: the same bytes with or without other prompts, no second encode."""
    pipe = fast["sd15"]
    pipe._text_cache.clear()
    calls = []
    encode = t2i.encode_prompts
    monkeypatch.setattr(t2i, "encode_prompts", lambda *a, **k: calls.append(a[2]) or encode(*a, **k))
    alone = pipe._text_states(["a red dress"], None, 1)
    crowd = pipe._text_states(["a blue shoe", "a red dress", "a bag"], [""] * 3, 2)
    assert calls == [["a red dress"], [""], ["a blue shoe"], ["a bag"]]
    assert torch.equal(crowd[8], alone[0]) and torch.equal(crowd[9], alone[0])
    assert crowd.shape[0] == 12


def test_pipeline_from_pretrained_gives_the_text_pipeline(sd15):
    root, _ = sd15
    pipe = fastdiff.Pipeline.from_pretrained(root, device="cpu", sampler="euler")
    assert isinstance(pipe, TextToImagePipeline) and pipe.steps == 50 and pipe.sampler_name == "euler"
    assert isinstance(fastdiff.load_unet(root), UNet2DConditionModel)
    with pytest.raises(FastdiffError, match="unknown backend 'tensorrt'"):
        fastdiff.Pipeline.from_pretrained(root, device="cpu", backend="tensorrt")


def one_line_error(call, match: str) -> None:
    with pytest.raises(FastdiffError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and match in message, message


BAD_CALLS = [
    (dict(prompt=PROMPTS, seeds=[1, 2, 3]), "got 3 seeds for 2 images"),
    (dict(prompt=PROMPTS, num_images_per_prompt=2, seeds=[1, 2]), "got 2 seeds for 4 images"),
    (dict(prompt="a", height=60), "height must be a positive multiple of 8"),
    (dict(prompt="a", width=0), "width must be a positive multiple of 8"),
    (dict(prompt="a", image="photo.png"), "image must be a PIL image"),
    (dict(prompt="a", image=torch.zeros(4, 64, 64)), "image must be a PIL image"),
    (dict(prompt="a", image=Image.new("RGB", (60, 64))), "not a multiple of 8"),
    (dict(prompt="a", image=Image.new("RGB", (64, 64)), strength=0), "strength must be in (0, 1]"),
    (dict(prompt="a", image=Image.new("RGB", (64, 64)), strength=1.5), "strength must be in (0, 1]"),
    (dict(prompt="a", image=Image.new("RGB", (64, 64)), strength=0.1, steps=5), "leaves none of the 5 steps"),
    (dict(prompt="a", image=Image.new("RGB", (64, 64)), height=32), "differ from the init image"),
    (dict(prompt="a", image=[Image.new("RGB", (64, 64))] * 2), "got 2 init images for 1 prompts"),
    (dict(prompt="a", sampler="plms"), "unknown sampler 'plms'"),
    (dict(prompt=["a", 3]), "prompt must be a string"),
    (dict(prompt=PROMPTS, negative_prompt=["x"]), "got 1 negative prompts for 2 prompts"),
    (dict(prompt="a", latents=torch.zeros(1, 4, 4, 4)), "latents have shape (1, 4, 4, 4)"),
    (dict(prompt="a", output_type="latent"), "unknown output_type"),
    (dict(prompt="a", cache_interval=0), "cache_interval must be an integer >= 1"),
    (dict(prompt=PROMPTS, guidance_scale=[3.0]), "one per prompt (2)"),
    (dict(prompt=PROMPTS, guidance_scale=[3.0, float("nan")]), "finite number >= 0"),
    (dict(prompt=PROMPTS, guidance_scale=[3.0, 1.0]), "mix guided (> 1) and unguided"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_inputs_fail_before_any_work(kwargs, match, fast, monkeypatch):
    def no_work(*args, **kw):
        raise AssertionError("work started before the inputs were checked")

    monkeypatch.setattr(t2i, "encode_prompts", no_work)
    monkeypatch.setattr(t2i, "denoise", no_work)
    one_line_error(lambda: fast["sd15"](progress=False, **kwargs), match)


def test_bad_directories_and_names(sd15, tmp_path):
    root, _ = sd15
    broken = tmp_path / "no-text-encoder"
    shutil.copytree(root, broken)
    shutil.rmtree(broken / "text_encoder")
    one_line_error(lambda: fastdiff.Pipeline.from_pretrained(broken, device="cpu"), "missing text_encoder/")
    one_line_error(lambda: TextToImagePipeline.from_pretrained(root, sampler="plms"), "unknown sampler 'plms'")


def png_parameters(path) -> dict:
    with Image.open(path) as image:
        return json.loads(image.text["parameters"])


def test_cli_writes_pngs_with_their_parameters(sd15, tmp_path):
    root, _ = sd15
    out, each = tmp_path / "grid.png", tmp_path / "each"
    rc = main(["sample", "--model", str(root), "--prompt", "a cat", "--negative-prompt", "ugly", "--steps", "2",
               "--batch", "2", "--seed", "7", "--device", "cpu", "--out", str(out), "--save-dir", str(each),
               "--no-progress"])  # fmt: skip
    assert rc == 0
    grid = png_parameters(out)
    assert grid["prompt"] == "a cat" and grid["negative_prompt"] == "ugly" and grid["seeds"] == [7, 8]
    assert grid["sampler"] == "ddim" and grid["steps"] == 2 and grid["guidance"] == 7.5
    assert grid["model"] == str(root)
    second = png_parameters(each / "000008.png")
    assert second["seed"] == 8 and second["prompt"] == "a cat" and "seeds" not in second

    source = tmp_path / "init.png"
    init_image(4).save(source)
    rc = main(["sample", "--model", str(root), "--prompt", "ein Bild, 猫", "--init-image", str(source), "--steps",
               "3", "--batch", "1", "--device", "cpu", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0
    params = png_parameters(out)
    assert params["prompt"] == "ein Bild, 猫" and params["strength"] == 0.6 and params["init_image"] == str(source)


def test_cli_repeated_prompt_draws_one_row_per_prompt(tmp_path):
    """Several --prompt: one grid row of --batch images per prompt (the bundled preset, 32x32), all prompts and
    seeds recorded in the grid's parameters, each image's own prompt in its PNG."""
    pytest.importorskip("transformers")
    out, each = tmp_path / "grid.png", tmp_path / "each"
    prompts = ["a photo of a bag", "sneaker", "a photo of a dress"]
    flags = [arg for prompt in prompts for arg in ("--prompt", prompt)]
    rc = main(["sample", "--model", "fashion-mnist-t2i", *flags, "--guidance", "3", "--steps", "2", "--batch",
               "2", "--seed", "10", "--device", "cpu", "--out", str(out), "--save-dir", str(each),
               "--no-progress"])  # fmt: skip
    assert rc == 0
    grid = png_parameters(out)
    assert grid["prompt"] == prompts and grid["seeds"] == list(range(10, 16)) and grid["guidance"] == 3.0
    assert grid["model"] == "fashion-mnist-t2i" and (grid["width"], grid["height"]) == (32, 32)
    with Image.open(out) as image:
        width, height = image.size
    with Image.open(each / "000010.png") as image:
        assert image.size == (32, 32)
    # make_grid: 2 columns, 3 rows of 32-pixel tiles with a 2-pixel border
    assert (width, height) == (2 * 34 + 2, 3 * 34 + 2)
    assert [png_parameters(each / f"{seed:06d}.png")["prompt"] for seed in range(10, 16)] == [
        prompt for prompt in prompts for _ in range(2)
    ]
    # the grid's row p holds prompt p's images, as the pipeline draws them
    pipe = TextToImagePipeline.from_pretrained("fashion-mnist-t2i", device="cpu", steps=2)
    row = pipe("sneaker", guidance_scale=3.0, seeds=[12, 13], num_images_per_prompt=2, progress=False)
    for seed, expected in zip((12, 13), row, strict=True):
        with Image.open(each / f"{seed:06d}.png") as image:
            assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(expected.convert("RGB")))


CLI_ERRORS = [
    (["--model", "{sd}"], "is a text-to-image model: give --prompt"),
    (["--model", "fashion-mnist", "--prompt", "a cat"], "--prompt needs a text-to-image model"),
    (["--model", "{sd}", "--prompt", "a", "--strength", "0.5"], "--strength needs --init-image"),
    (["--model", "{sd}", "--negative-prompt", "x"], "--negative-prompt needs --prompt"),
    (["--model", "{sd}", "--prompt", "a", "--height", "30"], "height must be a positive multiple of 8"),
    (["--model", "{sd}", "--prompt", "a", "--init-image", "{missing}"], "cannot read --init-image"),
    (["--model", "{sd}", "--prompt", "a", "--init-image", "{init}", "--strength", "2"], "strength must be in"),
    (["--model", "{sd}", "--prompt", "a", "--guidance-interval", "0.5", "0.4"], "--guidance-interval needs 0 <="),
    (["--model", "{sd}", "--guidance-interval", "0.2", "1"], "--guidance-interval needs --prompt"),
]


@pytest.mark.parametrize(("flags", "match"), CLI_ERRORS, ids=[m for _, m in CLI_ERRORS])
def test_cli_errors_are_one_line(flags, match, sd15, tmp_path, capsys, monkeypatch):
    root, _ = sd15

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(fastdiff.pipelines.unconditional.Pipeline, "from_pretrained", no_work)
    init_image(1).save(tmp_path / "init.png")
    names = {"sd": str(root), "missing": str(tmp_path / "missing.png"), "init": str(tmp_path / "init.png")}
    argv = ["sample", "--device", "cpu", "--out", str(tmp_path / "g.png")] + [f.format(**names) for f in flags]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and match in errors[0], errors
    assert not (tmp_path / "g.png").exists()


def test_generate_without_prompts_refuses_a_text_model_in_one_line(sd15, tmp_path, capsys):
    """generate of a text-to-image model needs its prompts: a one-line error (exit 2), before any sampling."""
    root = sd15[0]
    from fastdiff.cli import main

    out_dir = tmp_path / "gen"
    assert main(["generate", "--model", str(root), "--num-images", "2", "--out-dir", str(out_dir), "--device", "cpu",
                 "--steps", "2"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "text-to-image" in err and len(err.strip().splitlines()) == 1, err
    assert not any(out_dir.glob("*.png"))


@pytest.mark.slow
@pytest.mark.parametrize("img2img", [False, True], ids=["text", "img2img"])
def test_engine_backend_matches_diffusers(sd15, img2img, monkeypatch):
    """The engine backend (fused U-Net loop with guidance in the sampler-step kernel, fused VAE decode; the Triton
    interpreter on the CPU) against diffusers' pipeline, DPM-Solver++; noise handed over as in the img2img test."""
    root, pipe = sd15
    engine = TextToImagePipeline.from_pretrained(root, device="cpu", sampler="dpmsolver++", backend="engine")
    assert engine.backend == "engine" and engine.unet.conv_in.weight.device.type == "cpu"  # streamed from host
    shape, seeds = (1, 4, SIZE // 8, SIZE // 8), [5, 6]
    draws = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
             for g in (torch.Generator().manual_seed(s) for s in seeds)]  # fmt: skip
    posterior, added = (torch.cat(d) for d in zip(*draws, strict=True))
    kwargs = dict(negative_prompt=NEGATIVES, output_type="np", num_inference_steps=2)
    if img2img:  # 4 steps at strength 0.5: the last 2 run
        monkeypatch.setattr(t2i, "posterior_noise", lambda seed_ids, latent_shape: posterior)
        kwargs.update(image=init_image(3), strength=0.5, num_inference_steps=4)
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        expected = with_scheduler(root, pipe, "dpmsolver++", img2img=True)(PROMPTS, generator=generators, **kwargs)
    else:
        expected = with_scheduler(root, pipe, "dpmsolver++")(PROMPTS, latents=added.clone(), **kwargs)
    steps = kwargs.pop("num_inference_steps")
    ours = engine(PROMPTS, steps=steps, latents=added, progress=False, **kwargs)
    assert engine.uses_engine(shape[1:]) and engine.engine.decoders  # the fused decode ran
    assert max_abs(ours, expected.images) <= TOL
    if not img2img:  # a guidance interval: the engine's loop reads the table's switch column as the eager step does
        late = dict(steps=steps, latents=added, progress=False, guidance_interval=(0.5, 1.0), **kwargs)
        eager = TextToImagePipeline.from_pretrained(root, device="cpu", sampler="dpmsolver++", backend="eager")
        mine, reference = engine(PROMPTS, **late), eager(PROMPTS, **late)
        assert max_abs(mine, reference) <= TOL and max_abs(mine, ours) > 5 * TOL


@pytest.mark.slow
def test_fp8_engine_stays_near_the_eager_image(sd15):
    """``dtype="fp8"``: the U-Net's ResNet convs in e4m3 on the engine (the Triton interpreter on the CPU), the rest
    fp16; two guided DPM-Solver++ steps keep the image at >= 30 dB PSNR of the eager fp32 pipeline's (the fp8
    quality guard on SD configs)."""
    root, _ = sd15
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a Hopper GPU, or Triton's interpreter
    fp8 = TextToImagePipeline.from_pretrained(root, device=device, dtype="fp8", sampler="dpmsolver++")
    eager = TextToImagePipeline.from_pretrained(root, device=device, sampler="dpmsolver++", backend="eager")
    kwargs = dict(steps=2, seeds=[5], negative_prompt=NEGATIVES[0], output_type="np", progress=False)
    ours, reference = fp8(PROMPTS[0], **kwargs), eager(PROMPTS[0], **kwargs)
    assert fp8.backend == "engine" and fp8.dtype == torch.float16
    assert fp8.engine.current_step_model.fp8_ops > 0
    mse = float(np.mean((ours.astype(np.float64) - reference) ** 2))
    assert np.isfinite(ours).all() and 0 < mse and 10 * np.log10(1 / mse) >= 30


def test_step_cache_reaches_both_backends(fast, monkeypatch):
    """cache_interval reaches the eager loop (``denoise``) and Engine.prepare (the cached loops themselves are
    tested in tests/engine/test_step_cache.py, ``denoise`` being the reference there)."""
    seen = []

    def stop(*args, **kwargs):
        seen.append(args[8] if len(args) > 8 else kwargs["cache_interval"])
        raise InterruptedError

    monkeypatch.setattr(t2i, "denoise", stop)
    engine = TextToImagePipeline(fast["sd15"].components, steps=3, backend="engine")
    monkeypatch.setattr(type(engine.engine), "prepare", stop)
    for pipe, interval in ((fast["sd15"], 2), (engine, 3)):
        with pytest.raises(InterruptedError):
            pipe("a cat", cache_interval=interval, steps=3, progress=False)
    assert seen == [2, 3]


def test_random_weight_presets_are_text_to_image_names(tmp_path, monkeypatch):
    """ "sd15" / "sd21" name random-weight Stable Diffusion pipelines (speed runs), unless a folder of that name
    exists here (a local path wins, as for the other presets)."""
    from fastdiff.models.stable_diffusion import is_random_preset

    assert t2i.is_text_to_image_dir("sd15") and t2i.is_text_to_image_dir("sd21")
    assert not t2i.is_text_to_image_dir("ddpm-cifar10") and not is_random_preset("sd3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sd15").mkdir()
    assert not is_random_preset("sd15") and not t2i.is_text_to_image_dir("sd15")


@pytest.mark.slow
def test_img2img_on_the_grayscale_bundled_model():
    """fashion-mnist-t2i's VAE takes one channel: an RGB init image is encoded as the mean of its channels, so a
    tinted image gives the image of its gray mean."""
    pipe = TextToImagePipeline.from_pretrained("fashion-mnist-t2i", device="cpu", steps=4)
    gray = np.random.default_rng(0).random((32, 32, 1), dtype=np.float32) * 0.8
    kwargs = dict(seeds=3, strength=0.5, guidance_scale=3.0, output_type="np", progress=False)
    out = pipe("a photo of a bag", image=np.repeat(gray, 3, axis=-1), **kwargs)
    assert out.shape == (1, 32, 32, 1)
    tinted = np.repeat(gray, 3, axis=-1) * np.array([0.8, 1.0, 1.2], dtype=np.float32)  # the same channel mean
    np.testing.assert_allclose(pipe("a photo of a bag", image=tinted, **kwargs), out, atol=1e-4)
    other = pipe("a photo of a bag", image=np.repeat(gray[::-1], 3, axis=-1), **kwargs)
    assert np.abs(other - out).max() > 0.05  # the init image matters


def test_a_call_with_more_texts_than_the_cache_holds(fast, monkeypatch):
    """More distinct texts in one call than ``TEXT_CACHE_SIZE``: all are used, the cache keeps the newest."""
    pipe = fast["sd15"]
    monkeypatch.setattr(t2i, "TEXT_CACHE_SIZE", 2)
    monkeypatch.setattr(
        t2i, "encode_prompts", lambda enc, tok, texts, dev, **kw: torch.full((1, 3), float(len(texts[0])))
    )
    pipe._text_cache.clear()
    states = pipe._text_states(["a", "bb", "ccc"], ["", "", ""], 1)
    assert states[:, 0].tolist() == [0, 0, 0, 1, 2, 3] and len(pipe._text_cache) == 2
    pipe._text_cache.clear()
