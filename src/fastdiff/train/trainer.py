"""Training a ConvNeXt U-Net (ε- or v-prediction) with AdamW, an EMA of the weights and exact resume.

``train(config)`` runs until ``max_steps`` (counted over all resumed runs) or ``max_minutes`` (this run),
writing to ``out_dir``: ``checkpoint.pt`` (all it takes to continue bit-exactly: model, EMA, optimizer, step,
data-order and noise RNG states, the loss log), ``loss.jsonl``, ``loss.png``, ``samples/step_XXXXXX.png``
(EMA model, DDIM, fixed seeds) and ``summary.json``. A second ``train`` on the same ``out_dir`` resumes.
``export_model`` writes the EMA weights as a model directory that ``fastdiff.models.load_unet`` loads.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fastdiff.atomic import write_atomic, write_text_atomic
from fastdiff.devices import resolve_device
from fastdiff.errors import FastdiffError
from fastdiff.images import make_grid, save_figure_atomic, save_png_atomic, to_pil
from fastdiff.models.convnext_unet import (
    CONVNEXT_PRESETS,
    ConvNeXtUNet,
    ConvNeXtUNetConfig,
    config_from_dict,
    save_convnext_unet,
)
from fastdiff.pipelines.unconditional import sample_loop
from fastdiff.samplers import ScheduleConfig, alphas_cumprod, initial_noise, make_sampler, seed_tensor

log = logging.getLogger(__name__)

PREDICTIONS = ("epsilon", "v_prediction")
SCHEDULES = {"cosine": "squaredcos_cap_v2", "linear": "linear"}
"""--schedule name -> diffusers ``beta_schedule``."""

CHECKPOINT_NAME = "checkpoint.pt"
LOSS_LOG_NAME = "loss.jsonl"
LOSS_CURVE_NAME = "loss.png"
SUMMARY_NAME = "summary.json"
SAMPLES_DIR = "samples"
REPORT_SECONDS = 30.0
"""Seconds between progress lines in the log (the tqdm bar updates every step)."""
FINAL_LOSS_RECORDS = 10
"""The final loss is the mean over the steps of the last this many loss-log records."""

RESUME_KEYS = (
    "model_config",
    "prediction",
    "schedule",
    "num_train_timesteps",
    "batch_size",
    "lr",
    "warmup_steps",
    "weight_decay",
    "ema_decay",
    "grad_clip",
    "seed",
    "hflip",
    "limit_images",
)
"""Settings a resumed run must share with the checkpoint (the others, e.g. max_steps, may change)."""


@dataclass
class TrainConfig:
    """Everything a training run needs. ``model_config`` (if given) replaces the ``model`` preset."""

    model: str = "fashion-mnist"
    model_config: ConvNeXtUNetConfig | None = None
    prediction: str = "v_prediction"
    schedule: str = "cosine"
    num_train_timesteps: int = 1000
    lr: float = 5e-4
    warmup_steps: int = 500
    batch_size: int = 256
    weight_decay: float = 0.01
    ema_decay: float = 0.9995
    grad_clip: float = 1.0
    max_steps: int = 20000
    max_minutes: float | None = None
    sample_every: int = 2000
    sample_steps: int = 50
    num_samples: int = 64
    checkpoint_every: int = 2000
    log_every: int = 50
    seed: int = 0
    data_dir: Path | None = None
    limit_images: int | None = None
    hflip: bool = False
    out_dir: Path = field(default_factory=lambda: Path("runs/fashion-mnist"))
    device: str = "auto"
    bf16: bool = True
    channels_last: bool = True
    compile: bool = False
    progress: bool = True


def validate_config(config: TrainConfig) -> None:
    """Raise a FastdiffError naming the first bad setting."""
    if config.prediction not in PREDICTIONS:
        raise FastdiffError(f"unknown prediction {config.prediction!r}: use one of {', '.join(PREDICTIONS)}")
    if config.schedule not in SCHEDULES:
        raise FastdiffError(f"unknown schedule {config.schedule!r}: use one of {', '.join(SCHEDULES)}")
    positive = ("max_steps", "batch_size", "num_train_timesteps", "checkpoint_every", "log_every")
    positive += ("sample_steps", "num_samples")
    for name in positive:
        if getattr(config, name) <= 0:
            raise FastdiffError(f"{name} must be positive, got {getattr(config, name)}")
    for name in ("sample_every", "warmup_steps", "weight_decay", "grad_clip"):
        if getattr(config, name) < 0:
            raise FastdiffError(f"{name} must be >= 0, got {getattr(config, name)}")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise FastdiffError(f"lr must be positive, got {config.lr}")
    if not 0 <= config.ema_decay < 1:
        raise FastdiffError(f"ema_decay must be in [0, 1), got {config.ema_decay}")
    if config.max_minutes is not None and config.max_minutes <= 0:
        raise FastdiffError(f"max_minutes must be positive, got {config.max_minutes}")
    if config.limit_images is not None and config.limit_images <= 0:
        raise FastdiffError(f"limit_images must be positive, got {config.limit_images}")


def resolve_model_config(config: TrainConfig) -> ConvNeXtUNetConfig:
    """``config.model_config``, else the ConvNeXt preset named by ``config.model``."""
    if config.model_config is not None:
        return config.model_config
    if config.model not in CONVNEXT_PRESETS:
        raise FastdiffError(
            f"unknown model preset {config.model!r} for training: use one of {', '.join(sorted(CONVNEXT_PRESETS))}"
        )
    return CONVNEXT_PRESETS[config.model]


def scheduler_config_for(config: TrainConfig) -> dict:
    """The diffusers-style (DDIMScheduler) scheduler config that matches how the model is trained."""
    return {
        "_class_name": "DDIMScheduler",
        "num_train_timesteps": config.num_train_timesteps,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": SCHEDULES[config.schedule],
        "trained_betas": None,
        "prediction_type": config.prediction,
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "timestep_spacing": "trailing",
        "variance_type": "fixed_small",
        "thresholding": False,
        "rescale_betas_zero_snr": False,
    }


def config_to_dict(config: TrainConfig, model_config: ConvNeXtUNetConfig) -> dict:
    """JSON-safe dict of the run's settings (paths as strings, the resolved model config as a dict)."""
    data = dataclasses.asdict(dataclasses.replace(config, model_config=model_config))
    return json.loads(json.dumps(data, default=str))


def load_training_images(config: TrainConfig, model_config: ConvNeXtUNetConfig) -> torch.Tensor:
    """Fashion-MNIST train split, padded to the model's sample size, [N, 1, S, S] in [-1, 1]."""
    from fastdiff.data import load_fashion_mnist

    images, _ = load_fashion_mnist("train", data_dir=config.data_dir, pad_to=model_config.sample_size)
    return images


def save_checkpoint_atomic(state: dict, path: Path) -> None:
    """``torch.save`` all or nothing (a crash never leaves half a checkpoint)."""
    write_atomic(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: Path) -> dict:
    """The checkpoint dict (tensors on the CPU); a FastdiffError if it is missing or unreadable."""
    if not path.is_file():
        raise FastdiffError(f"no checkpoint at {path}: train first (fastdiff train --out {path.parent})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or foreign file
        raise FastdiffError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc


def plot_loss_curve(records: list[dict], path: Path) -> Path | None:
    """Loss against step (raw and smoothed, log scale) as a PNG; None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return None
    if not records:
        return None
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    smoothed, avg = [], 0.0
    for k, value in enumerate(losses, start=1):
        avg = 0.9 * avg + 0.1 * value
        smoothed.append(avg / (1 - 0.9**k))  # bias-corrected: no drag towards the first value
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    ax.plot(steps, smoothed, color="tab:blue", linewidth=1.5, label="smoothed")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path)
    return path


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float, updates: int) -> None:
    """EMA with warm-up: decay min(decay, (1 + n) / (10 + n)) after n earlier updates; buffers are copied."""
    d = min(decay, (1 + updates) / (10 + updates))
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - d)
    for ema_buf, buf in zip(ema.buffers(), model.buffers(), strict=True):
        ema_buf.copy_(buf)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and conv kernels only, not on biases, norms or scales."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    """One training run over images held on the device; ``run()`` trains and returns the summary dict."""

    def __init__(self, config: TrainConfig, images: torch.Tensor | None = None) -> None:
        self.created = time.perf_counter()
        validate_config(config)
        self.config = config
        self.out_dir = Path(config.out_dir)
        self.device = resolve_device(config.device)
        self.model_config = resolve_model_config(config)
        self.settings = config_to_dict(config, self.model_config)
        self.scheduler_config = scheduler_config_for(config)
        self.schedule = ScheduleConfig.from_diffusers(self.scheduler_config)
        self.on_cuda = self.device.type == "cuda"
        self.use_bf16 = config.bf16 and self.on_cuda
        self.memory_format = torch.channels_last if config.channels_last and self.on_cuda else torch.contiguous_format
        if self.on_cuda:
            torch.backends.cudnn.benchmark = True

        if images is None:
            images = load_training_images(config, self.model_config)
        if config.limit_images is not None:
            images = images[: config.limit_images]
        expected = (
            self.model_config.in_channels,
            self.model_config.sample_size,
            self.model_config.sample_size,
        )
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise FastdiffError(f"training images have shape {tuple(images.shape)}, the model needs [N, *{expected}]")
        if images.shape[0] < config.batch_size:
            raise FastdiffError(f"batch size {config.batch_size} is larger than the {images.shape[0]} training images")
        self.images = images.to(self.device, torch.float32).contiguous(memory_format=self.memory_format)
        self.num_images = images.shape[0]
        self.steps_per_epoch = self.num_images // config.batch_size

        abar = alphas_cumprod(self.schedule).to(self.device)
        if abar.shape[0] != config.num_train_timesteps:
            raise FastdiffError(f"schedule has {abar.shape[0]} steps, expected {config.num_train_timesteps}")
        self.sqrt_abar = abar.sqrt().float()
        self.sqrt_one_minus_abar = (1 - abar).sqrt().float()

        torch.manual_seed(config.seed)
        self.model = ConvNeXtUNet(self.model_config).to(self.device, memory_format=self.memory_format)
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        fused = {"fused": True} if self.on_cuda else {}
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, config.weight_decay), lr=config.lr, betas=(0.9, 0.999), **fused
        )
        self.forward = torch.compile(self.model) if config.compile else self.model
        self.data_rng = torch.Generator().manual_seed(config.seed)
        self.noise_rng = torch.Generator(device=self.device).manual_seed(config.seed + 1)

        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.epoch_rng_state = self.data_rng.get_state()
        self.records: list[dict] = []
        self.train_seconds = 0.0
        self.resumed_from: int | None = None
        self.last_grid: Path | None = None
        self.num_params = sum(p.numel() for p in self.model.parameters())

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_state(self) -> dict:
        state = {
            "format": 1,
            "settings": self.settings,
            "scheduler_config": self.scheduler_config,
            "num_images": self.num_images,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch_rng_state": self.epoch_rng_state,
            "noise_rng_state": self.noise_rng.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "records": self.records,
            "train_seconds": self.train_seconds,
        }
        if self.on_cuda:
            state["cuda_rng_state"] = torch.cuda.get_rng_state(self.device)
        return state

    def save_checkpoint(self) -> None:
        save_checkpoint_atomic(self.checkpoint_state(), self.checkpoint_path)
        log.debug("checkpoint at step %d written to %s", self.step, self.checkpoint_path)

    def resume(self) -> None:
        """Continue from ``out_dir/checkpoint.pt`` if it exists (settings must match, see RESUME_KEYS)."""
        if not self.checkpoint_path.is_file():
            return
        ckpt = load_checkpoint(self.checkpoint_path)
        saved = ckpt["settings"]
        for key in RESUME_KEYS:
            if saved.get(key) != self.settings[key]:
                raise FastdiffError(
                    f"{self.checkpoint_path} was trained with {key}={saved.get(key)!r}, not "
                    f"{self.settings[key]!r}: use the same settings or another --out directory"
                )
        if ckpt["num_images"] != self.num_images:
            raise FastdiffError(
                f"{self.checkpoint_path} was trained on {ckpt['num_images']} images, this data has {self.num_images}"
            )
        self.model.load_state_dict(ckpt["model"])
        self.ema.load_state_dict(ckpt["ema"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.step = ckpt["step"]
        self.epoch = ckpt["epoch"]
        self.batch_in_epoch = ckpt["batch_in_epoch"]
        self.epoch_rng_state = ckpt["epoch_rng_state"]
        self.noise_rng.set_state(ckpt["noise_rng_state"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        if self.on_cuda and "cuda_rng_state" in ckpt:
            torch.cuda.set_rng_state(ckpt["cuda_rng_state"], self.device)
        self.records = list(ckpt["records"])
        self.train_seconds = ckpt["train_seconds"]
        self.resumed_from = self.step
        log.info("resumed from %s at step %d (epoch %d)", self.checkpoint_path, self.step, self.epoch)

    # ---------------------------------------------------------------- training

    def epoch_order(self) -> torch.Tensor:
        """This epoch's permutation, drawn from the data-order generator state saved at the epoch's start."""
        self.data_rng.set_state(self.epoch_rng_state)
        return torch.randperm(self.num_images, generator=self.data_rng).to(self.device)

    def train_step(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One AdamW step on the diffusion loss; returns (loss, gradient norm) as device tensors."""
        cfg = self.config
        batch = x0.shape[0]
        if cfg.hflip:
            flip = torch.rand(batch, generator=self.noise_rng, device=self.device) < 0.5
            x0 = torch.where(flip.view(-1, 1, 1, 1), x0.flip(-1), x0)
        t = torch.randint(0, cfg.num_train_timesteps, (batch,), generator=self.noise_rng, device=self.device)
        noise = torch.randn(x0.shape, generator=self.noise_rng, device=self.device)
        a = self.sqrt_abar[t].view(-1, 1, 1, 1)
        s = self.sqrt_one_minus_abar[t].view(-1, 1, 1, 1)
        x_t = (a * x0 + s * noise).contiguous(memory_format=self.memory_format)
        target = noise if cfg.prediction == "epsilon" else a * noise - s * x0
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (self.step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            out = self.forward(x_t, t)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.update_ema()
        return loss.detach(), grad_norm.detach()

    def update_ema(self) -> None:
        ema_update(self.ema, self.model, self.config.ema_decay, self.step)

    @torch.no_grad()
    def sample_grid(self) -> Path:
        """A grid of ``num_samples`` EMA-model images (DDIM, seeds 0..n-1) in samples/step_XXXXXX.png."""
        cfg = self.config
        sampler = make_sampler("ddim", self.schedule, cfg.sample_steps, eta=0.0, device=self.device)
        shape = (self.model_config.in_channels, self.model_config.sample_size, self.model_config.sample_size)
        seeds = seed_tensor(range(cfg.num_samples), self.device)
        x_t = initial_noise(seeds, shape, self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            images = sample_loop(self.ema, sampler, x_t, seeds, torch.float32)
        path = self.out_dir / SAMPLES_DIR / f"step_{self.step:06d}.png"
        save_png_atomic(make_grid(to_pil(images)), path)
        self.last_grid = path
        return path

    def run(self) -> dict:
        cfg = self.config
        start = self.created
        deadline = None if cfg.max_minutes is None else start + 60 * cfg.max_minutes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.resume()
        # Lines written after the checkpoint belong to steps that will be redone: rewrite the log from it.
        write_text_atomic(self.out_dir / LOSS_LOG_NAME, "".join(json.dumps(r) + "\n" for r in self.records))
        start_step = self.step
        stopped = "max_steps"
        log.info(
            "training %s (%.2f M params) on %d images, batch %d, %s, %s schedule, on %s%s",
            cfg.model if cfg.model_config is None else "custom model",
            self.num_params / 1e6,
            self.num_images,
            cfg.batch_size,
            cfg.prediction,
            cfg.schedule,
            self.device,
            " (bf16 autocast)" if self.use_bf16 else "",
        )
        order = self.epoch_order() if self.step < cfg.max_steps else None
        loss_sum = torch.zeros((), device=self.device)
        interval_steps, interval_start = 0, time.perf_counter()
        loop_start = last_report = run_start = interval_start
        bar = tqdm(total=cfg.max_steps, initial=self.step, unit="step", desc="training", disable=not cfg.progress)
        self.model.train()
        with bar, (self.out_dir / LOSS_LOG_NAME).open("a") as loss_log:
            while self.step < cfg.max_steps:
                b = self.batch_in_epoch * cfg.batch_size
                loss, grad_norm = self.train_step(self.images[order[b : b + cfg.batch_size]])
                loss_sum += loss
                interval_steps += 1
                self.step += 1
                self.batch_in_epoch += 1
                if self.batch_in_epoch == self.steps_per_epoch:
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    self.epoch_rng_state = self.data_rng.get_state()
                    order = self.epoch_order()
                bar.update(1)
                out_of_time = deadline is not None and time.perf_counter() >= deadline
                last = self.step == cfg.max_steps or out_of_time
                if self.step % cfg.log_every == 0 or last:
                    now = time.perf_counter()
                    record = {
                        "step": self.step,
                        "epoch": self.epoch,
                        "loss": loss_sum.item() / interval_steps,
                        "loss_steps": interval_steps,
                        "grad_norm": grad_norm.item(),
                        "lr": self.optimizer.param_groups[0]["lr"],
                        "images_per_s": interval_steps * cfg.batch_size / (now - interval_start),
                        "elapsed_s": round(self.train_seconds + now - loop_start, 3),
                    }
                    self.records.append(record)
                    loss_log.write(json.dumps(record) + "\n")
                    loss_log.flush()
                    bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
                    if now - last_report >= REPORT_SECONDS or last:
                        log.info(
                            "step %d (epoch %d): mean loss %.4f over the last %d steps, %.0f img/s",
                            self.step,
                            self.epoch,
                            record["loss"],
                            interval_steps,
                            record["images_per_s"],
                        )
                        last_report = now
                    loss_sum.zero_()
                    interval_steps, interval_start = 0, now
                if cfg.sample_every and (self.step % cfg.sample_every == 0 or last):
                    log.info("step %d: sample grid %s", self.step, self.sample_grid())
                if self.step % cfg.checkpoint_every == 0 or last:
                    self.train_seconds += time.perf_counter() - loop_start
                    loop_start = time.perf_counter()
                    self.save_checkpoint()
                if interval_steps == 0:  # keep sampling and checkpoint time out of the next img/s figure
                    interval_start = time.perf_counter()
                if out_of_time and self.step < cfg.max_steps:
                    stopped = "max_minutes"
                    break
        loop_seconds = time.perf_counter() - run_start
        seconds = time.perf_counter() - start
        curve = plot_loss_curve(self.records, self.out_dir / LOSS_CURVE_NAME)
        summary = self.summary(stopped, start_step, seconds, loop_seconds, curve)
        write_text_atomic(self.out_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        if summary["final_loss"] is None:
            loss = "no loss logged"
        else:
            loss = f"final loss {summary['final_loss']:.4f} (mean over the last {summary['final_loss_steps']} steps)"
        log.info(
            "stopped at step %d (%s) after %.1f s: %s, %s img/s",
            self.step,
            stopped,
            seconds,
            loss,
            summary["images_per_s"],
        )
        return summary

    def summary(self, stopped: str, start_step: int, seconds: float, loop_seconds: float, curve: Path | None) -> dict:
        """What ``run`` returns: where training stands, this run's speed (training loop, sampling included)."""
        recent = self.records[-FINAL_LOSS_RECORDS:]
        weights = [r.get("loss_steps", 1) for r in recent]  # records of runs before "loss_steps" weigh equally
        recent_steps = sum(weights)
        final_loss = sum(r["loss"] * n for r, n in zip(recent, weights, strict=True)) / recent_steps if recent else None
        trained = self.step - start_step
        return {
            "step": self.step,
            "epoch": self.epoch,
            "images_seen": self.step * self.config.batch_size,
            "stopped": stopped,
            "resumed_from": self.resumed_from,
            "steps_this_run": trained,
            "seconds_this_run": round(seconds, 3),
            "images_per_s": round(trained * self.config.batch_size / loop_seconds, 1) if trained else None,
            "train_seconds_total": round(self.train_seconds, 3),
            "final_loss": None if final_loss is None else round(final_loss, 6),
            "final_loss_steps": recent_steps,
            "params": self.num_params,
            "device": str(self.device),
            "checkpoint": str(self.checkpoint_path),
            "loss_log": str(self.out_dir / LOSS_LOG_NAME),
            "loss_curve": None if curve is None else str(curve),
            "samples": None if self.last_grid is None else str(self.last_grid),
            "settings": self.settings,
        }


def train(config: TrainConfig, images: torch.Tensor | None = None) -> dict:
    """Train (or resume training in ``config.out_dir``) and return the summary dict (also in summary.json).

    ``images`` ([N, C, S, S] in [-1, 1]) replaces the Fashion-MNIST train split read from ``config.data_dir``.
    """
    return Trainer(config, images).run()


def export_model(out_dir: Path, dest_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write the EMA weights of ``out_dir/checkpoint.pt`` as a model directory (config.json, safetensors,
    scheduler_config.json) that ``fastdiff.models.load_unet(dest_dir)`` loads."""
    ckpt = load_checkpoint(Path(out_dir) / CHECKPOINT_NAME)
    model = ConvNeXtUNet(config_from_dict(ckpt["settings"]["model_config"], str(Path(out_dir) / CHECKPOINT_NAME)))
    model.load_state_dict(ckpt["ema"])
    dest_dir = Path(dest_dir)
    save_convnext_unet(model.eval(), dest_dir, scheduler_config=ckpt["scheduler_config"], dtype=dtype)
    log.info("exported the EMA weights of step %d to %s (%s)", ckpt["step"], dest_dir, dtype)
    return dest_dir
