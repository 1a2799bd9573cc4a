"""The trainer on CPU with a tiny ConvNeXt U-Net: the loss falls, resume is bit-exact, max_minutes stops with
a checkpoint, export round-trips through load_unet and the Pipeline, and bad input gives one-line errors."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest
import torch

from fastdiff.cli import main
from fastdiff.data import DEFAULT_DATA_DIR
from fastdiff.errors import FastdiffError
from fastdiff.models import ConvNeXtUNet, load_unet
from fastdiff.models.convnext_unet import ConvNeXtUNetConfig
from fastdiff.pipelines import Pipeline
from fastdiff.train.trainer import CHECKPOINT_NAME, TrainConfig, export_model, load_checkpoint, train

TINY = ConvNeXtUNetConfig(
    sample_size=16,
    in_channels=1,
    out_channels=1,
    base_dim=8,
    dim_mults=(1, 2),
    convnext_mult=1,
    attention_heads=1,
    attention_head_dim=8,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny convolutions gain nothing from threads, and oversubscribed cores make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(out_dir: Path, **overrides) -> TrainConfig:
    settings = dict(
        model_config=TINY,
        batch_size=16,
        lr=2e-3,
        warmup_steps=5,
        max_steps=12,
        sample_every=0,
        num_samples=4,
        sample_steps=3,
        checkpoint_every=1000,
        log_every=1,
        seed=3,
        device="cpu",
        out_dir=out_dir,
        progress=False,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def squares(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    """Synthetic images: a bright square of random size and place on a dark background, [n, 1, size, size]."""
    gen = torch.Generator().manual_seed(seed)
    images = -torch.ones(n, 1, size, size)
    for i in range(n):
        side = int(torch.randint(4, size // 2 + 1, (), generator=gen))
        r, c = torch.randint(0, size - side + 1, (2,), generator=gen).tolist()
        images[i, 0, r : r + side, c : c + side] = 1.0
    return images


def losses(out_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out_dir / "loss.jsonl").read_text().splitlines()]


def assert_loss_falls(values: list[float]) -> None:
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert all(torch.isfinite(torch.tensor(values)))
    assert last < 0.75 * first, f"loss did not fall: first 5 {first:.4f}, last 5 {last:.4f}"


def test_loss_falls_on_synthetic_images(tmp_path):
    summary = train(tiny_config(tmp_path, max_steps=40), squares(160))
    values = losses(tmp_path)
    assert len(values) == 40 and summary["step"] == 40 and summary["stopped"] == "max_steps"
    assert_loss_falls(values)
    assert (tmp_path / CHECKPOINT_NAME).is_file()
    assert summary["epoch"] == 4  # 160 images / batch 16 = 10 steps per epoch


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_DATA_DIR.is_dir(), reason="needs apt-get install dataset-fashion-mnist")
def test_loss_falls_on_fashion_mnist(tmp_path):
    model = ConvNeXtUNetConfig(**{**vars(TINY), "sample_size": 28})  # the 28x28 images, unpadded
    config = tiny_config(
        tmp_path,
        model_config=model,
        data_dir=DEFAULT_DATA_DIR,
        limit_images=320,
        max_steps=30,
        prediction="epsilon",
    )
    summary = train(config)
    assert summary["step"] == 30
    assert_loss_falls(losses(tmp_path))


def state_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of nested state dicts / lists (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_resume_is_bit_exact(tmp_path):
    images = squares(72, seed=1)  # 4 steps per epoch (8 images dropped): the split falls mid-epoch
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = dict(hflip=True, sample_every=5, warmup_steps=3)
    train(tiny_config(straight, max_steps=13, **common), images)
    first = train(tiny_config(split, max_steps=6, **common), images)
    assert first["step"] == 6 and first["epoch"] == 1
    second = train(tiny_config(split, max_steps=13, **common), images)
    assert second["resumed_from"] == 6 and second["step"] == 13

    a, b = load_checkpoint(straight / CHECKPOINT_NAME), load_checkpoint(split / CHECKPOINT_NAME)
    for key in ("model", "ema", "optimizer", "epoch_rng_state", "noise_rng_state", "step", "epoch"):
        assert state_equal(a[key], b[key]), key
    assert not state_equal(a["model"], a["ema"])  # the EMA is a separate average, not a copy
    assert losses(straight) == losses(split)  # same batches, same noise: identical loss values
    assert [r["step"] for r in b["records"]] == list(range(1, 14))
    grids = sorted(p.name for p in (split / "samples").iterdir())
    assert grids == ["step_000005.png", "step_000006.png", "step_000010.png", "step_000013.png"]


def test_resume_refuses_other_settings(tmp_path):
    images = squares(32)
    train(tiny_config(tmp_path, max_steps=2), images)
    with pytest.raises(FastdiffError, match="lr"):
        train(tiny_config(tmp_path, max_steps=4, lr=1e-3), images)
    with pytest.raises(FastdiffError, match="trained on 32 images"):
        train(tiny_config(tmp_path, max_steps=4), squares(48))


def test_max_minutes_stops_with_checkpoint_then_resumes(tmp_path):
    images = squares(48)
    summary = train(tiny_config(tmp_path, max_steps=50, max_minutes=1e-6, sample_every=10), images)
    assert summary["stopped"] == "max_minutes" and summary["step"] == 1
    ckpt = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert ckpt["step"] == 1 and len(ckpt["records"]) == 1
    assert (tmp_path / "samples" / "step_000001.png").is_file()  # a final grid even when stopped early
    summary = train(tiny_config(tmp_path, max_steps=3, sample_every=10), images)
    assert summary["resumed_from"] == 1 and summary["step"] == 3 and summary["stopped"] == "max_steps"
    assert len(losses(tmp_path)) == 3
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 3


def test_export_loads_with_load_unet_and_samples(tmp_path):
    run, dest = tmp_path / "run", tmp_path / "model"
    train(tiny_config(run, max_steps=3, prediction="v_prediction", schedule="cosine"), squares(32))
    export_model(run, dest, dtype=torch.float16)
    model = load_unet(dest)
    assert isinstance(model, ConvNeXtUNet)
    assert model.scheduler_config["prediction_type"] == "v_prediction"
    assert model.scheduler_config["beta_schedule"] == "squaredcos_cap_v2"
    assert model.scheduler_config["num_train_timesteps"] == 1000
    ema = load_checkpoint(run / CHECKPOINT_NAME)["ema"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, ema[name].half().float()), name

    pipe = Pipeline.from_pretrained(dest, device="cpu", steps=4)
    images = pipe(batch_size=2, output_type="tensor", progress=False)
    assert images.shape == (2, 1, 16, 16) and torch.isfinite(images).all()


def test_files_have_the_umask_mode(tmp_path, umask):
    run, dest = tmp_path / "run", tmp_path / "model"
    train(tiny_config(run, max_steps=2, sample_every=2, checkpoint_every=1), squares(32))
    export_model(run, dest, dtype=torch.float16)
    files = [p for p in (*run.rglob("*"), *dest.rglob("*")) if p.is_file()]
    names = {p.name for p in files}
    assert {"checkpoint.pt", "loss.jsonl", "loss.png", "summary.json", "step_000002.png"} <= names
    assert {"config.json", "model.safetensors"} <= names
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == dict.fromkeys(names, 0o666 & ~umask)


def test_final_loss_is_the_step_weighted_mean_it_says(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fastdiff.train.trainer"):
        summary = train(tiny_config(tmp_path, max_steps=7, log_every=3), squares(32))
    records = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss_steps"]) for r in records] == [(3, 3), (6, 3), (7, 1)]
    expected = (3 * records[0]["loss"] + 3 * records[1]["loss"] + records[2]["loss"]) / 7
    assert summary["final_loss"] == pytest.approx(expected, abs=1e-6) and summary["final_loss_steps"] == 7
    last = caplog.records[-1].getMessage()
    assert f"final loss {expected:.4f} (mean over the last 7 steps)" in last, last
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 7 ")]
    assert len(progress) == 1 and f"mean loss {records[2]['loss']:.4f} over the last 1 steps" in progress[0]


def test_bad_input_raises_one_line_errors(tmp_path):
    images = squares(32)
    with pytest.raises(FastdiffError, match="dataset-fashion-mnist"):
        train(tiny_config(tmp_path, model_config=None, data_dir=tmp_path / "missing"))
    for field, value in (
        ("max_steps", 0),
        ("max_steps", -3),
        ("batch_size", 0),
        ("lr", 0.0),
        ("ema_decay", 1.0),
    ):
        with pytest.raises(FastdiffError, match=field):
            train(tiny_config(tmp_path, **{field: value}), images)
    with pytest.raises(FastdiffError, match="prediction"):
        train(tiny_config(tmp_path, prediction="sample"), images)
    with pytest.raises(FastdiffError, match="larger than the 32 training images"):
        train(tiny_config(tmp_path, batch_size=64), images)
    with pytest.raises(FastdiffError, match="shape"):
        train(tiny_config(tmp_path), squares(32, size=12))
    with pytest.raises(FastdiffError, match="unknown model preset"):
        train(tiny_config(tmp_path, model_config=None, model="ddpm-cifar10"), images)
    with pytest.raises(FastdiffError, match="no checkpoint"):
        export_model(tmp_path / "nothing", tmp_path / "out")
    assert not (tmp_path / CHECKPOINT_NAME).exists()


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--data", "--out", "--steps", "--batch", "--lr", "--prediction", "--schedule",
                 "--max-minutes", "--sample-every", "--device", "--seed", "--export"):  # fmt: skip
        assert flag in text
    assert main(["train", "--steps", "0", "--out", str(tmp_path / "a"), "--device", "cpu"]) == 2
    assert "steps must be positive" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "b"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "dataset-fashion-mnist" in err and err.count("\n") == 1
