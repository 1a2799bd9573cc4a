"""The text-to-image recipe on the CPU: prompts and tokenizer; both stages with the tiny preset on synthetic images;
the written StableDiffusionPipeline directory loaded and sampled by fastdiff and by diffusers (same latents, same
images); the CLI's one-line errors; and both stages through the CLI on Fashion-MNIST (skipped without the data)."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import stat

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastdiff.cli import main
from fastdiff.data import DEFAULT_DATA_DIR, FASHION_MNIST_CLASSES
from fastdiff.errors import FastdiffError
from fastdiff.models.autoencoder_kl import AutoencoderKL, autoencoder_kl_from_dir
from fastdiff.models.stable_diffusion import BUNDLED_PIPELINES, load_stable_diffusion
from fastdiff.models.unet_2d_condition import UNet2DConditionModel
from fastdiff.models.weights import read_json_object, read_state_dict
from fastdiff.quality.psnr import psnr
from fastdiff.train import text_to_image as t2i
from fastdiff.train.text_to_image import UNetStageConfig, VAEStageConfig, loop, unet_stage, vae_stage
from fastdiff.train.text_to_image.config import find_vae_dir, make_text_encoder
from fastdiff.train.text_to_image.prompts import learn_merges, prompt_words

TOL = 1e-3  # max abs diff on [0, 1] output images, fp32, as tests/test_text_to_image.py
needs_data = pytest.mark.skipif(not DEFAULT_DATA_DIR.is_dir(), reason="needs apt-get install dataset-fashion-mnist")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny convolutions gain nothing from threads, and oversubscribed cores make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def squares(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic Fashion-MNIST stand-ins: a bright centred square whose side (4..22) is set by the class."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = -torch.ones(n, 1, 32, 32)
    for i, label in enumerate(labels.tolist()):
        lo = 16 - (2 + label)
        images[i, 0, lo : 32 - lo, lo : 32 - lo] = 1.0
    return images, labels


def stage_settings(out_dir, **overrides) -> dict:
    """Tiny, CPU, 30 steps at a high learning rate: enough for the text to move the images (see the diffusers test)."""
    settings = dict(out_dir=out_dir, preset="tiny", batch_size=16, max_steps=30, lr=3e-3, warmup_steps=2, log_every=10)
    return {**settings, "device": "cpu", "progress": False, **overrides}


# ---------------------------------------------------------------- prompts and tokenizer


def test_every_class_is_reachable_and_no_prompt_is_ambiguous():
    rng = random.Random(0)
    owner: dict[str, int] = {}
    for label in range(10):
        prompts = t2i.class_prompts(label)
        assert len(prompts) == len(set(prompts)) >= 10
        for prompt in prompts:
            assert owner.setdefault(prompt, label) == label, f"{prompt!r} names classes {owner[prompt]} and {label}"
        drawn = {t2i.random_prompt(label, rng) for _ in range(400)}
        assert drawn <= set(prompts) and len(drawn) > len(prompts) // 2
    assert "" not in owner
    canonical = t2i.canonical_prompts()
    assert canonical[9] == "a photo of an ankle boot" and canonical[1] == "a photo of trousers"
    assert [owner[p] for p in canonical] == list(range(10))
    assert len(canonical) == len(FASHION_MNIST_CLASSES)
    # what users type reaches the right class, the brief's examples included
    for text, label in [("ankle boot", 9), ("a photo of an ankle boot", 9), ("a pullover, product photo", 2),
                        ("tee", 0), ("top", 0), ("pants", 1), ("handbag", 8), ("boot", 9), ("sneaker", 7)]:  # fmt: skip
        assert owner[text] == label, text
    prompts, labels = t2i.prompt_table()
    assert prompts[-1] == t2i.EMPTY_PROMPT and labels[-1] == -1 and len(prompts) == len(owner) + 1
    with pytest.raises(FastdiffError, match="out of range"):
        t2i.class_prompts(10)


def test_articles():
    assert [t2i.noun_phrase(n) for n in ("ankle boot", "bag", "trousers", "tee shirt", "pair of pants")] == [
        "an ankle boot",
        "a bag",
        "trousers",
        "a tee shirt",
        "a pair of pants",
    ]


def test_learned_merges_rebuild_each_word_in_order():
    """learn_merges on a toy corpus, applied by hand (lowest rank first, as CLIP's BPE does), joins every word."""
    words = ["boot", "boots", "bag", "top"]
    merges = learn_merges(words)
    rank = {pair: i for i, pair in enumerate(merges)}
    for word in words:
        symbols = [*word[:-1], word[-1] + "</w>"]
        while len(symbols) > 1:
            pairs = [(rank.get(p, len(rank)), i) for i, p in enumerate(zip(symbols, symbols[1:], strict=False))]
            best, i = min(pairs)
            assert best < len(rank), f"{word}: stuck at {symbols}"
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        assert symbols == [word + "</w>"]
    assert merges[0] == ("b", "o")  # the most frequent pair (boot, boots, and bo-) comes first


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    return t2i.build_tokenizer()


def test_every_prompt_word_is_one_token_in_any_case(tokenizer):
    vocab = tokenizer.get_vocab()
    words = prompt_words()
    assert {"ankle", "boot", "trousers", "t", "-", "shirt", "handbag", "tee", "sneaker", ","} <= set(words)
    for word in words:
        assert word + "</w>" in vocab, word
        assert tokenizer.tokenize(word) == [word + "</w>"]
        assert tokenizer.tokenize(word.upper()) == [word + "</w>"]
    ids = t2i.tokenize(tokenizer, ["A Photo of an ANKLE BOOT", "a photo of an ankle boot", ""])
    assert ids.shape == (3, 77) and torch.equal(ids[0], ids[1])
    expected = ["<|startoftext|>", "a</w>", "photo</w>", "of</w>", "an</w>", "ankle</w>", "boot</w>", "<|endoftext|>"]
    assert tokenizer.convert_ids_to_tokens(ids[0][:8].tolist()) == expected
    assert ids[2][:2].tolist() == [tokenizer.bos_token_id, tokenizer.eos_token_id]
    assert (ids[0][8:] == tokenizer.pad_token_id).all()  # SD 1.x pads with <|endoftext|>
    # words outside the vocabulary still tokenize, as byte-level pieces
    assert "".join(tokenizer.tokenize("zebra")) == "zebra</w>"


@pytest.mark.parametrize("name", [name for name in t2i.PRESETS if name != "tiny"])
def test_fashion_preset_fits_the_size_budget(tokenizer, name):
    """fp16 safetensors of each real preset stay under 30 MB; the VAE maps 32x32x1 to the U-Net's latents, the
    shape its name says (16x16x4 for the bundled one)."""
    preset = t2i.PRESETS[name]
    vae, unet = AutoencoderKL(preset.vae), UNet2DConditionModel(preset.unet)
    text_encoder = make_text_encoder(preset, tokenizer)
    total = sum(loop.num_params(m) for m in (vae, unet, text_encoder))
    assert 2 * total <= 30e6, f"{total} parameters"
    latents = vae.encode(torch.zeros(1, 1, 32, 32)).mean
    assert tuple(latents.shape[1:]) == (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    c, h, w = latents.shape[1:]
    assert name.endswith(f"{h}x{w}x{c}") or (name == "fashion-mnist" and (c, h, w) == (4, 16, 16))
    assert text_encoder.config.hidden_size == unet.config.cross_attention_dim


# ---------------------------------------------------------------- both stages, tiny, synthetic data


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(vae stage folder, pipeline folder, vae summary, unet summary, train images, test images)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("t2i")
    images, labels = squares(96, seed=0)
    test_images, _ = squares(24, seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vae_summary = t2i.train_vae(
            VAEStageConfig(**stage_settings(root / "vae-stage", scaling_images=64, fd_images=0)), images, test_images
        )
        unet_config = UNetStageConfig(
            **stage_settings(root / "pipeline", vae_dir=root / "vae-stage"),
            eval_per_class=1,
            eval_steps=2,
            grid_per_prompt=1,
        )
        unet_summary = t2i.train_text_to_image(unet_config, images, labels)
    finally:
        torch.set_num_threads(threads)
    return root / "vae-stage", root / "pipeline", vae_summary, unet_summary, images, test_images


def test_vae_stage_writes_its_vae_scaling_factor_and_psnr(trained):
    vae_dir, _, summary, _, images, test_images = trained
    assert {p.name for p in vae_dir.iterdir()} >= {"vae", "summary.json", "loss.jsonl", "reconstructions.png"}
    assert json.loads((vae_dir / "summary.json").read_text())["psnr_db"] == summary["psnr_db"]
    config = read_json_object(vae_dir / "vae" / "config.json")
    assert config["_class_name"] == "AutoencoderKL" and config["in_channels"] == 1
    assert config["scaling_factor"] == summary["scaling_factor"]
    weights = read_state_dict(vae_dir / "vae" / "diffusion_pytorch_model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float16}
    vae = autoencoder_kl_from_dir(vae_dir / "vae", config).float().eval()

    # scaling_factor = 1 / std of the sampled latents of the first scaling_images training images (same draw)
    mean, std = vae_stage.encode_batches(vae, images[:64], torch.device("cpu"))
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(0 + 2))
    assert config["scaling_factor"] == pytest.approx(1 / float((mean + std * noise).std()), rel=1e-4)
    # PSNR of decode(posterior mean) on the test images, recomputed from the saved weights
    with torch.no_grad():
        recon = vae.decode(vae.encode(test_images).mean).clamp(-1, 1)
    assert summary["psnr_db"] == pytest.approx(float(psnr(recon, test_images).mean()), abs=2e-3)
    assert summary["test_images"] == 24 and summary["step"] == 30 and summary["stopped"] == "max_steps"
    records = [json.loads(line) for line in (vae_dir / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30] and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_pipeline_directory_is_stable_diffusions_format(trained):
    _, root, _, summary, _, _ = trained
    index = read_json_object(root / "model_index.json")
    assert index["_class_name"] == "StableDiffusionPipeline" and index["requires_safety_checker"] is False
    assert index["safety_checker"] == [None, None] and index["feature_extractor"] == [None, None]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    scheduler = read_json_object(root / "scheduler" / "scheduler_config.json")
    assert scheduler["beta_schedule"] == "scaled_linear" and scheduler["prediction_type"] == "epsilon"
    assert (scheduler["beta_start"], scheduler["beta_end"], scheduler["num_train_timesteps"]) == (0.00085, 0.012, 1000)
    for part, name in (
        ("unet", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
    ):
        weights = read_state_dict(root / part / f"{name}.safetensors")
        assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float16}, part
    # the stage-1 VAE is shipped as it was written
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert (root / "vae" / name).read_bytes() == (trained[0] / "vae" / name).read_bytes()
    assert (
        summary["model_bytes"]
        == sum(p.stat().st_size for p in root.rglob("*") if p.parent != root)
        + (root / "model_index.json").stat().st_size
    )
    assert (root / "samples.png").is_file() and summary["step"] == 30
    written = json.loads((root / "summary.json").read_text())
    assert written["eval"]["per_class"] == 1 and set(written["eval"]["guidance"]) == {"3.0", "7.5"}
    assert 0 <= written["eval"]["guidance"]["7.5"]["accuracy"] <= 1


def test_files_have_the_umask_mode(trained):
    """Every file, safetensors and transformers' text-encoder files included, has the mode a plain write gives."""
    _, root, _, _, _, _ = trained
    modes = {p.relative_to(root): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}
    expected = stat.S_IMODE((root / "model_index.json").stat().st_mode)
    assert modes == dict.fromkeys(modes, expected) and len(modes) >= 12


def test_fastdiff_loads_and_samples_it(trained):
    _, root, _, _, _, _ = trained
    from fastdiff.pipelines.text_to_image import TextToImagePipeline

    components = load_stable_diffusion(root)
    assert components.vae.config.scaling_factor == read_json_object(root / "vae" / "config.json")["scaling_factor"]
    pipe = TextToImagePipeline(components, steps=3)
    assert pipe.vae_scale == 4 and pipe.default_size == (32, 32)  # 3 VAE levels: 4 pixels per latent
    assert pipe.latent_shape() == (4, 8, 8) and pipe.latent_shape(64, 48) == (4, 16, 12)
    images = pipe(["Ankle Boot", "a pullover, product photo"], seeds=[0, 1], output_type="np", progress=False)
    assert images.shape == (2, 32, 32, 1) and np.isfinite(images).all()
    wide = pipe("bag", seeds=2, height=32, width=48, output_type="pt", progress=False)
    assert wide.shape == (1, 1, 32, 48)


@pytest.mark.parametrize("model", ["tiny", "bundled"])
def test_diffusers_loads_it_and_draws_the_same_images(model, request):
    """diffusers' own StableDiffusionPipeline.from_pretrained(dir) and fastdiff, same latents, guidance 7.5: the
    tiny pipeline trained here and the bundled fashion-mnist-t2i preset (the recipe's output on Fashion-MNIST)."""
    pytest.importorskip("diffusers")
    import diffusers

    from fastdiff.pipelines.text_to_image import TextToImagePipeline
    from fastdiff.samplers import SAMPLER_SCHEDULERS

    if model == "tiny":
        root = request.getfixturevalue("trained")[1]
    else:
        pytest.importorskip("transformers")
        root = BUNDLED_PIPELINES["fashion-mnist-t2i"]
    reference = diffusers.StableDiffusionPipeline.from_pretrained(root, torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    scale = 4 if model == "tiny" else 2  # three VAE levels (8x8 latents) in tiny, two (16x16) in the bundled one
    assert reference.vae_scale_factor == scale and isinstance(reference.scheduler, diffusers.DDIMScheduler)
    ours = TextToImagePipeline.from_pretrained(root, device="cpu", steps=4)
    prompts = ["a photo of an ankle boot", "T-shirt"]
    latents = torch.randn(2, 4, 32 // scale, 32 // scale, generator=torch.Generator().manual_seed(3))
    kwargs = dict(negative_prompt=["", "bag"], guidance_scale=7.5, output_type="np")
    for sampler in ("ddim", "dpmsolver++"):
        scheduler = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_pretrained(root, subfolder="scheduler")
        expected = diffusers.StableDiffusionPipeline(**{**reference.components, "scheduler": scheduler})
        expected.set_progress_bar_config(disable=True)
        theirs = expected(prompts, num_inference_steps=4, latents=latents.clone(), **kwargs).images
        mine = ours(prompts, sampler=sampler, latents=latents, progress=False, **kwargs)
        assert mine.shape == theirs.shape == (2, 32, 32, 1)
        assert float(np.abs(mine - theirs).max()) <= TOL, sampler
    swapped = ours(prompts[::-1], latents=latents, progress=False, **kwargs)
    assert float(np.abs(swapped - mine).max()) > 10 * TOL  # the prompts matter at this tolerance


# ---------------------------------------------------------------- the bundled fashion-mnist-t2i preset


def test_bundled_preset_loads_through_every_entry_point():
    pytest.importorskip("transformers")
    import fastdiff
    from fastdiff.pipelines.text_to_image import TextToImagePipeline, is_text_to_image_dir

    root = BUNDLED_PIPELINES["fashion-mnist-t2i"]
    assert is_text_to_image_dir("fashion-mnist-t2i")
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    assert sum(sizes.values()) <= 30 * 2**20, sizes
    assert {name.split("/")[0] for name in sizes} == {
        "model_index.json", "training.json", "unet", "vae", "text_encoder", "tokenizer", "scheduler",
    }  # fmt: skip
    for part in ("unet/diffusion_pytorch_model", "vae/diffusion_pytorch_model", "text_encoder/model"):
        weights = read_state_dict(root / f"{part}.safetensors")
        assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float16}, part
    record = json.loads((root / "training.json").read_text())
    assert record["stage"] == "unet" and record["eval"]["guidance"]["3.0"]["accuracy"] > 0.8

    generic = fastdiff.Pipeline.from_pretrained("fashion-mnist-t2i", device="cpu", sampler="dpmsolver++", steps=4)
    direct = TextToImagePipeline.from_pretrained("fashion-mnist-t2i", device="cpu", sampler="dpmsolver++", steps=4)
    assert isinstance(generic, TextToImagePipeline) and generic.default_size == (32, 32)
    kwargs = dict(guidance_scale=3.0, seeds=[5, 6], output_type="np", progress=False)
    images = generic(["ankle boot", "a photo of trousers"], **kwargs)
    assert images.shape == (2, 32, 32, 1) and np.isfinite(images).all()
    assert np.array_equal(images, direct(["ankle boot", "a photo of trousers"], **kwargs))


def test_make_sample_draws_one_row_per_canonical_prompt():
    """The Makefile's prompt grid lists exactly the canonical class prompts, in label order."""
    import re
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "--model fashion-mnist-t2i" in makefile
    assert re.findall(r'--prompt "([^"]+)"', makefile) == t2i.canonical_prompts()


def test_learning_rate_follows_the_step_or_time_budget(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    by_steps = loop.Budget(VAEStageConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1), start=100.0)
    assert by_steps.lr(0) == pytest.approx(0.1)  # warm-up: (step + 1) / warmup_steps
    assert by_steps.lr(50) == pytest.approx(0.55)  # half-way down the cosine from 1 to 0.1
    assert by_steps.lr(100) == pytest.approx(0.1) and not by_steps.out_of_time()
    by_time = loop.Budget(VAEStageConfig(max_steps=10**6, warmup_steps=0, lr=1.0, max_seconds=60), start=90.0)
    clock[0] = 125.0  # the loop started at 100 with 50 s left: 25 s is half of them
    assert by_time.progress(10) == pytest.approx(0.5) and by_time.lr(10) == pytest.approx(0.55)
    assert not by_time.out_of_time()
    clock[0] = 150.0
    assert by_time.out_of_time() and by_time.progress(11) == 1.0


def test_a_resumed_stage_may_change_its_time_budget(monkeypatch):
    """A resumed run with another max_seconds: the span moves by the difference and the cosine follows it from
    where it stands; without one the budget is steps only."""
    clock = [1000.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    settings = dict(max_steps=10**6, warmup_steps=0, lr=1.0, min_lr_ratio=0.0)
    saved = {"span": 95.0, "used": 40.0, "max_seconds": 100.0}  # 5 s of set-up in the first run
    same = loop.Budget(VAEStageConfig(**settings, max_seconds=100.0), start=990.0, resumed=saved)
    assert same.span == 95.0 and same.left() == pytest.approx(55.0)
    shorter = loop.Budget(VAEStageConfig(**settings, max_seconds=65.0), start=990.0, resumed=saved)
    assert shorter.span == 60.0 and shorter.progress(0) == pytest.approx(40 / 60)
    clock[0] = 1019.9
    assert not shorter.out_of_time()
    clock[0] = 1020.0  # 40 + 20 s trained: the new total is spent
    assert shorter.out_of_time() and shorter.state() == {"span": 60.0, "used": 60.0, "max_seconds": 65.0}
    steps_only = loop.Budget(VAEStageConfig(**settings), start=990.0, resumed=saved)
    assert steps_only.span is None and not steps_only.out_of_time() and steps_only.left() == math.inf
    older = loop.Budget(VAEStageConfig(**settings, max_seconds=30.0), start=990.0, resumed={"span": None, "used": 5.0})
    assert older.span == 30.0  # a checkpoint without a time budget: the new one counts training seconds
    unrecorded = loop.Budget(
        VAEStageConfig(**settings, max_seconds=100.0), start=990.0, resumed={"span": 95.0, "used": 1}
    )
    assert unrecorded.span == 95.0  # a checkpoint that did not record its max_seconds keeps its span


def test_max_seconds_stops_a_stage_and_it_still_writes(tmp_path, monkeypatch):
    """... and the reconstruction FD (the floor) gets the first fd_images training images' reconstructions."""
    import fastdiff.quality.classifier as classifier

    seen = []

    def fake_fd(images, ref, **kwargs):
        assert ref == "test" and images.min() >= -1 and images.max() <= 1
        seen.append(tuple(images.shape))
        return 1.5

    monkeypatch.setattr(classifier, "fd_fmnist", fake_fd)
    images, _ = squares(32, seed=2)
    config = VAEStageConfig(**stage_settings(tmp_path / "v", max_seconds=1e-3, scaling_images=16, fd_images=20))
    summary = t2i.train_vae(config, images, images[:8])
    assert summary["stopped"] == "max_seconds" and summary["step"] == 1
    assert (tmp_path / "v" / "vae" / "config.json").is_file()
    assert seen == [(20, 1, 32, 32)]  # fd_images training images, reconstructed, to the FD
    assert summary["fd_fmnist_reconstructions"] == 1.5


def test_a_failing_evaluation_keeps_the_written_model(trained, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("no sampling today")

    monkeypatch.setattr(unet_stage, "evaluate_pipeline", broken)
    images, labels = squares(32, seed=3)
    config = UNetStageConfig(**stage_settings(tmp_path / "p", vae_dir=trained[0], max_steps=1))
    summary = t2i.train_text_to_image(config, images, labels)
    assert summary["eval"] == {"error": "TypeError: no sampling today"}
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["eval"] == summary["eval"]
    load_stable_diffusion(tmp_path / "p")


# ---------------------------------------------------------------- errors and the CLI


def one_line_cli_error(argv: list[str], match: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err


def test_cli_errors_come_before_any_work(trained, tmp_path, capsys, monkeypatch):
    vae_dir, pipeline_dir, _, _, _, _ = trained

    def no_work(*args, **kwargs):
        raise AssertionError("training data was read before the flags were checked")

    for stage in (vae_stage, unet_stage):
        monkeypatch.setattr(stage, "load_split", no_work)
    base = ["train", "text-to-image", "--device", "cpu", "--preset", "tiny"]
    out = str(tmp_path / "out")
    one_line_cli_error([*base, "--stage", "unet", "--out", out], "needs --vae", capsys)
    one_line_cli_error([*base, "--stage", "unet", "--out", out, "--vae", str(tmp_path / "nope")], "not found", capsys)
    one_line_cli_error([*base, "--stage", "unet", "--out", out, "--vae", str(tmp_path)], "holds no VAE", capsys)
    (tmp_path / "file").write_text("x")
    one_line_cli_error([*base, "--stage", "vae", "--out", str(tmp_path / "file" / "o")], "is a file", capsys)
    one_line_cli_error([*base, "--stage", "vae", "--out", out, "--steps", "0"], "max_steps must be a positive", capsys)
    one_line_cli_error([*base, "--stage", "vae", "--out", out, "--ema-decay", "0.9"], "--stage unet only", capsys)
    one_line_cli_error([*base, "--stage", "unet", "--out", out, "--vae", str(vae_dir), "--kl-weight", "1"],
                       "--stage vae only", capsys)  # fmt: skip
    one_line_cli_error([*base, "--stage", "unet", "--out", str(vae_dir), "--vae", str(vae_dir)], "another folder",
                       capsys)  # fmt: skip
    one_line_cli_error([*base, "--stage", "all", "--out", out, "--ema-decay", "1.5"], "ema_decay must be", capsys)
    one_line_cli_error([*base, "--stage", "all", "--out", out, "--vae", out], "another folder", capsys)
    one_line_cli_error([*base, "--stage", "all", "--out", out, "--init-from", str(pipeline_dir)],
                       "use it with --stage unet, not all", capsys)  # fmt: skip
    one_line_cli_error([*base, "--stage", "vae", "--out", out, "--init-from", str(pipeline_dir)],
                       "--init-from applies to --stage unet only", capsys)  # fmt: skip
    fashion = ["train", "text-to-image", "--device", "cpu", "--stage", "unet", "--out", out, "--vae", str(vae_dir)]
    one_line_cli_error(fashion, "use the same --preset", capsys)
    one_line_cli_error([*base, "--stage", "unet", "--out", out, "--vae", str(pipeline_dir), "--prompt-dropout", "1"],
                       "prompt_dropout", capsys)  # fmt: skip
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exc:
        main(["train", "text-to-image", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--stage", "--out", "--vae", "--max-seconds", "--steps", "--batch", "--preset", "--compile"):
        assert flag in text


def test_train_help_still_documents_the_convnext_trainer(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--prediction" in text and "text-to-image" in text


@needs_data
def test_cli_runs_both_stages_on_fashion_mnist(tmp_path):
    pytest.importorskip("transformers")
    common = ["--device", "cpu", "--preset", "tiny", "--limit-images", "64", "--batch", "16", "--steps", "3",
              "--log-every", "1", "--no-progress", "--data", str(DEFAULT_DATA_DIR)]  # fmt: skip
    vae_out, pipe_out = tmp_path / "vae", tmp_path / "pipe"
    assert (
        main(["train", "text-to-image", "--stage", "vae", "--out", str(vae_out), "--eval-images", "100", *common]) == 0
    )
    summary = json.loads((vae_out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["test_images"] == 100 and np.isfinite(summary["psnr_db"])
    argv = ["train", "text-to-image", "--stage", "unet", "--out", str(pipe_out), "--vae", str(vae_out),
            "--eval-per-class", "0", "--grid-per-prompt", "1", "--eval-steps", "2", *common]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((pipe_out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["num_images"] == 64 and "guidance" not in summary["eval"]
    assert (pipe_out / "samples.png").is_file()
    load_stable_diffusion(pipe_out)


@needs_data
def test_cli_stage_all_runs_both_stages_in_one_command_and_resumes(tmp_path, caplog):
    """--stage all: the vae stage into OUT-vae, then the unet stage on it into OUT; paused in the vae stage, the
    same command goes on from the checkpoint and then trains the unet stage; a finished vae stage is reused."""
    pytest.importorskip("transformers")
    pipe_out = tmp_path / "pipe"
    argv = ["train", "text-to-image", "--stage", "all", "--out", str(pipe_out), "--device", "cpu", "--preset", "tiny",
            "--limit-images", "64", "--batch", "16", "--steps", "3", "--log-every", "1", "--no-progress", "--data",
            str(DEFAULT_DATA_DIR), "--eval-images", "50", "--fd-images", "0", "--eval-per-class", "0",
            "--grid-per-prompt", "0"]  # fmt: skip
    vae_out = tmp_path / "pipe-vae"
    assert main([*argv, "--pause-after", "1e-9"]) == 0
    assert loop.checkpoint_path(vae_out).is_file() and not vae_out.exists() and not pipe_out.exists()
    with caplog.at_level(logging.INFO, logger="fastdiff.train.cli"):
        assert main(argv) == 0
    assert not loop.checkpoint_path(vae_out).exists()
    assert json.loads((vae_out / "summary.json").read_text())["step"] == 3
    summary = json.loads((pipe_out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["vae"] == str(vae_out / "vae")
    load_stable_diffusion(pipe_out)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastdiff.train.cli"):
        assert main([*argv, "--steps", "1"]) == 0  # a new unet stage on the finished vae stage
    assert "holds a finished one" in caplog.text
    assert json.loads((pipe_out / "summary.json").read_text())["step"] == 1
    assert json.loads((vae_out / "summary.json").read_text())["step"] == 3


# ---------------------------------------------------------------- pause and resume


def weights_of(folder) -> dict[str, torch.Tensor]:
    return read_state_dict(next(folder.glob("*.safetensors")))


@pytest.mark.parametrize("stage", ["vae", "unet"])
def test_a_paused_stage_resumes_to_the_weights_of_one_run(stage, trained, tmp_path):
    """--pause-after: the first run stops after a step and leaves only OUT.checkpoint.pt; the same command again
    trains on to the same weights, bit for bit, as a run that never paused, and removes the checkpoint."""
    images, labels = squares(64, seed=4)

    def run(out, **overrides):
        settings = stage_settings(out, max_steps=5, **overrides)
        if stage == "vae":
            return t2i.train_vae(VAEStageConfig(**settings, scaling_images=16, fd_images=0), images, images[:8])
        config = UNetStageConfig(**settings, vae_dir=trained[0], eval_per_class=0, grid_per_prompt=0)
        return t2i.train_text_to_image(config, images, labels)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = run(tmp_path / "whole")
        paused = run(tmp_path / "paused", pause_after_s=1e-9)
        checkpoint = loop.checkpoint_path(tmp_path / "paused")
        assert paused == {"stage": stage, "step": 1, "stopped": "paused", "checkpoint": str(checkpoint)}
        assert checkpoint.is_file() and not (tmp_path / "paused").exists()
        with pytest.raises(FastdiffError, match="lr=0.003, not 0.002"):
            run(tmp_path / "paused", lr=2e-3)
        resumed = run(tmp_path / "paused")
    finally:
        torch.set_num_threads(threads)
    assert resumed["step"] == whole["step"] == 5 and resumed["stopped"] == "max_steps"
    assert not checkpoint.exists()
    part = "vae" if stage == "vae" else "unet"
    mine, reference = weights_of(tmp_path / "paused" / part), weights_of(tmp_path / "whole" / part)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)
    log_lines = (tmp_path / "paused" / "loss.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in log_lines]
    assert steps[0] == 1 and steps[-1] == 5  # the paused run's records carry on in the resumed run's log


def test_epoch_batches_skip_replays_the_order():
    def take(skip, n):
        batches = loop.epoch_batches(10, 3, torch.Generator().manual_seed(0), torch.device("cpu"), skip=skip)
        return [next(batches).tolist() for _ in range(n)]

    assert take(0, 8)[5:] == take(5, 3)  # 3 batches per epoch: the skip crosses an epoch


def test_a_failed_compiled_first_step_is_retried_from_the_same_noise():
    """The eager retry after a torch.compile failure draws the noise the failed step drew (a resumed run's first
    step too), so a fallback does not shift the noise stream against a run that never failed."""
    rng = torch.Generator().manual_seed(0)
    draws, calls = [], []

    def step(batch):
        draws.append(torch.rand(2, generator=rng))
        if not calls:
            calls.append(1)
            raise RuntimeError("inductor says no")
        return "ok"

    assert loop.run_first_step(step, torch.zeros(1), lambda: None, rng) == "ok"
    assert torch.equal(draws[0], draws[1])


def test_init_from_continues_a_trained_pipeline(trained, tmp_path):
    """--init-from: the stage starts from a pipeline's U-Net and text encoder. One step at a vanishing learning
    rate writes the same fp16 weights back (a fresh start would write others); a pipeline of another VAE or another
    preset is refused in one line before any work."""
    vae_dir, pipeline_dir = trained[0], trained[1]
    images, labels = squares(32, seed=5)
    settings = stage_settings(tmp_path / "again", max_steps=1, lr=1e-20, warmup_steps=0)
    config = UNetStageConfig(**settings, vae_dir=vae_dir, init_from=pipeline_dir, eval_per_class=0, grid_per_prompt=0)
    t2i.train_text_to_image(config, images, labels)
    for part in ("unet", "text_encoder"):
        mine, trained_weights = weights_of(tmp_path / "again" / part), weights_of(pipeline_dir / part)
        assert mine.keys() == trained_weights.keys()
        assert all(torch.equal(mine[k], trained_weights[k]) for k in mine), part

    other_vae = tmp_path / "other-vae"
    shutil.copytree(vae_dir, other_vae)
    weights_file = next((other_vae / "vae").glob("*.safetensors"))
    state = read_state_dict(weights_file)
    state = {k: v + 1 if k == next(iter(state)) else v for k, v in state.items()}
    save_file(state, str(weights_file))
    refused = UNetStageConfig(**stage_settings(tmp_path / "x"), vae_dir=other_vae, init_from=pipeline_dir)
    with pytest.raises(FastdiffError, match="was trained on another VAE than --vae"):
        t2i.train_text_to_image(refused, images, labels)
    with pytest.raises(FastdiffError, match="is no text-to-image pipeline directory: unet/config.json is missing"):
        t2i.train_text_to_image(UNetStageConfig(**stage_settings(tmp_path / "x"), vae_dir=vae_dir, init_from=vae_dir))
    other_words = tmp_path / "other-words"
    shutil.copytree(pipeline_dir, other_words)
    vocab = json.loads((other_words / "tokenizer" / "vocab.json").read_text())
    first, second = list(vocab)[300:302]  # two words trade ids: same size, other embeddings
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other_words / "tokenizer" / "vocab.json").write_text(json.dumps(vocab))
    swapped = UNetStageConfig(**stage_settings(tmp_path / "x"), vae_dir=vae_dir, init_from=other_words)
    with pytest.raises(FastdiffError, match="its tokenizer is not this recipe's .tokenizer/vocab.json differs"):
        t2i.train_text_to_image(swapped, images, labels)
    bundled_dir = BUNDLED_PIPELINES["fashion-mnist-t2i"]
    for given in (bundled_dir, "fashion-mnist-t2i"):  # its folder, or its name (which the settings then record)
        bundled = UNetStageConfig(**stage_settings(tmp_path / "x"), vae_dir=vae_dir, init_from=given)
        with pytest.raises(FastdiffError, match="its U-Net is not the preset's architecture"):
            t2i.train_text_to_image(bundled, images, labels)
    assert find_vae_dir("fashion-mnist-t2i") == bundled_dir / "vae"  # --vae takes the name too (--init-from's default)
    assert not (tmp_path / "x").exists()
