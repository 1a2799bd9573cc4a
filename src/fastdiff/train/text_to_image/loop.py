"""What both stages train with: the device set-up, the data (Fashion-MNIST, padded) and its batches, the step
and time budget with its learning-rate schedule, the loss log, the budgeted training loop itself (with
torch.compile's fallback to eager at the first step), and the checkpoint a paused stage resumes from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdiff.devices import resolve_device
from fastdiff.errors import FastdiffError
from fastdiff.train.text_to_image.config import IMAGE_SIZE, StageConfig
from fastdiff.train.trainer import REPORT_SECONDS, load_checkpoint, save_checkpoint_atomic

log = logging.getLogger(__name__)


class Budget:
    """Where a stage stands against ``max_steps`` and ``max_seconds`` (from ``start``), and its learning rate:
    linear warm-up over ``warmup_steps``, then a cosine from ``lr`` to ``lr * min_lr_ratio`` over the fraction
    of the budget used, by steps or by time, whichever is further along.

    A resumed stage passes its checkpoint's ``state()``: the training seconds of the budget (``span``, fixed by the
    first run: ``max_seconds`` less its set-up), those already used and the ``max_seconds`` it was given, so that the
    cosine goes on where it paused. A resumed run may give another ``max_seconds``, a new total for the stage: the
    span moves by the difference (the first run's set-up still counted once) and the cosine follows the new span from
    where it stands."""

    def __init__(self, config: StageConfig, start: float, resumed: dict | None = None) -> None:
        self.config = config
        self.loop_start = time.perf_counter()
        if resumed is not None:
            self.span, self.used_before = resumed["span"], resumed["used"]
            before, now = resumed.get("max_seconds"), config.max_seconds
            if now is None:
                self.span = None
            elif self.span is None:
                self.span = now  # no time budget before: the new one counts training seconds only
            elif before is not None and now != before:
                self.span += now - before
                log.info("time budget %.0f s -> %.0f s: %.0f s of training left", before, now, self.left())
        else:
            self.span = None if config.max_seconds is None else start + config.max_seconds - self.loop_start
            self.used_before = 0.0
        self.deadline = None if self.span is None else self.loop_start + self.span - self.used_before

    def trained_s(self) -> float:
        """Seconds in the training loop, over every run of this stage."""
        return self.used_before + time.perf_counter() - self.loop_start

    def state(self) -> dict:
        return {"span": self.span, "used": self.trained_s(), "max_seconds": self.config.max_seconds}

    def left(self) -> float:
        """Training seconds left in the time budget (inf without one)."""
        return math.inf if self.span is None else self.span - self.trained_s()

    def progress(self, step: int) -> float:
        done = step / self.config.max_steps
        if self.span is not None:
            done = max(done, self.trained_s() / max(self.span, 1e-9))
        return min(done, 1.0)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def lr(self, step: int) -> float:
        cfg = self.config
        warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        cosine = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def setup_device(config: StageConfig) -> tuple[torch.device, bool, torch.memory_format]:
    """(device, bf16 autocast on, activation memory format); TF32 and cuDNN autotuning on CUDA."""
    device = resolve_device(config.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    memory_format = torch.channels_last if config.channels_last and on_cuda else torch.contiguous_format
    return device, config.bf16 and on_cuda, memory_format


def maybe_compile(fn: Callable[..., Any], enabled: bool) -> Callable[..., Any]:
    """``torch.compile(fn)`` if asked (compilation itself happens at the first call), else ``fn``; the module
    itself stays uncompiled, so its state dict keeps its names."""
    if not enabled:
        return fn
    try:
        return torch.compile(fn)
    except Exception as exc:  # no compiler backend on this machine: train eagerly
        log.warning("torch.compile unavailable (%s: %s): training eagerly", type(exc).__name__, exc)
        return fn


def run_first_step(
    step: Callable[[torch.Tensor], Any], batch: torch.Tensor, fallback: Callable[[], None],
    rng: torch.Generator | None = None,
) -> Any:  # fmt: skip
    """``step(batch)``, the first training step of a run; if it fails inside torch.compile, ``fallback()`` (switch
    to eager) and again, from the same state of ``rng`` (the step's noise generator), so that the draws the failed
    step made are made again."""
    state = rng.get_state() if rng is not None else None
    try:
        return step(batch)
    except (FastdiffError, KeyboardInterrupt, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:  # Dynamo / Inductor errors surface at the first compiled call
        log.warning("torch.compile failed at the first step (%s: %s): training eagerly", type(exc).__name__, exc)
        fallback()
        if rng is not None:
            rng.set_state(state)
        return step(batch)


def epoch_batches(
    num: int, batch: int, generator: torch.Generator, device: torch.device, skip: int = 0
) -> Iterator[torch.Tensor]:
    """Index batches of ``batch`` over ``num`` items, a new permutation each epoch (the remainder dropped), after
    the first ``skip`` batches (a resumed stage: the same order as if it had never paused)."""
    per_epoch = num // batch
    epochs, first = divmod(skip, per_epoch)
    for _ in range(epochs):
        torch.randperm(num, generator=generator)
    while True:
        order = torch.randperm(num, generator=generator).to(device)
        for b in range(first, per_epoch):
            yield order[b * batch : (b + 1) * batch]
        first = 0


class LossLog:
    """Loss records every ``log_every`` steps (means over the steps since the last record, one sync each), a
    tqdm bar and a progress line in the log every ``REPORT_SECONDS``."""

    def __init__(self, config: StageConfig, desc: str) -> None:
        self.config = config
        self.records: list[dict] = []
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.start = self.interval_start = self.last_report = time.perf_counter()
        self.bar = tqdm(total=config.max_steps, unit="step", desc=desc, disable=not config.progress)

    def add(self, step: int, values: dict[str, torch.Tensor], lr: float, last: bool) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums[key] + value.detach() if key in self.sums else value.detach().clone()
        self.steps += 1
        self.bar.update(1)
        if step % self.config.log_every and not last:
            return
        now = time.perf_counter()
        record = {"step": step, **{k: v.item() / self.steps for k, v in self.sums.items()}, "loss_steps": self.steps}
        record["lr"] = lr
        record["images_per_s"] = round(self.steps * self.config.batch_size / (now - self.interval_start), 1)
        record["elapsed_s"] = round(now - self.start, 3)
        self.records.append(record)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
        if now - self.last_report >= REPORT_SECONDS or last:
            log.info("step %d: loss %.4f, %.0f img/s", step, record["loss"], record["images_per_s"])
            self.last_report = now
        self.sums, self.steps, self.interval_start = {}, 0, now

    def resume(self, records: list[dict], step: int) -> None:
        """Continue a paused stage's log: its records so far (elapsed times go on from the last), the bar at
        ``step``."""
        self.records = list(records)
        if self.records:
            self.start -= self.records[-1]["elapsed_s"]
        self.bar.update(step)

    def close(self) -> None:
        self.bar.close()

    def final_loss(self) -> float | None:
        """Step-weighted mean loss of the last 10 records."""
        recent = self.records[-10:]
        steps = sum(r["loss_steps"] for r in recent)
        return round(sum(r["loss"] * r["loss_steps"] for r in recent) / steps, 6) if steps else None

    def jsonl(self) -> str:
        return "".join(json.dumps(r) + "\n" for r in self.records)


def run_budgeted_loop(
    config: Any,
    budget: Budget,
    loss_log: LossLog,
    optimizer: torch.optim.Optimizer,
    next_batch: Callable[[], torch.Tensor],
    train_step: Callable[[torch.Tensor], dict],
    eager: Callable[[], None],
    after_step: Callable[[int], None] | None = None,
    start_step: int = 0,
    run_start: float | None = None,
    rng: torch.Generator | None = None,
) -> tuple[int, str]:
    """The training loop of both stages: the budget's learning rate, one ``train_step`` per batch (the first one
    through ``run_first_step``, which falls back to ``eager`` if a compiled step fails), ``after_step(step)``
    (EMA), the loss log; from ``start_step`` (a resumed stage) until ``config.max_steps`` or the time budget runs
    out, or ``config.pause_after_s`` after ``run_start`` (this run's start) has passed; ``rng``: the noise
    generator of ``train_step``. Returns (steps, why): "max_steps", "max_seconds" or "paused"."""
    step, stopped = start_step, "max_steps"
    pause_at = None if config.pause_after_s is None or run_start is None else run_start + config.pause_after_s
    try:
        while step < config.max_steps:
            lr = budget.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = next_batch()
            values = run_first_step(train_step, batch, eager, rng) if step == start_step else train_step(batch)
            if after_step is not None:
                after_step(step)
            step += 1
            out_of_time = budget.out_of_time() or budget.progress(step) >= 1.0
            pause = pause_at is not None and time.perf_counter() >= pause_at and not out_of_time
            loss_log.add(step, values, lr, last=step == config.max_steps or out_of_time or pause)
            if step < config.max_steps and (out_of_time or pause):
                stopped = "max_seconds" if out_of_time else "paused"
                break
    finally:
        loss_log.close()
    return step, stopped


RESUME_KEYS = (
    "preset", "max_steps", "batch_size", "lr", "warmup_steps", "min_lr_ratio", "weight_decay",
    "grad_clip", "limit_images", "seed", "bf16", "kl_weight", "vae_dir", "ema_decay", "prompt_dropout",
    "min_snr_gamma", "init_from",
)  # fmt: skip
"""Settings a resumed stage must share with its checkpoint (those of the stage's config that shape training).
``max_seconds`` is not one: a resumed run may extend or shorten the stage's time budget (``Budget``)."""


def checkpoint_path(out_dir: Path) -> Path:
    """Where a paused stage keeps its state: next to its output folder (OUT.checkpoint.pt), as OUT itself is only
    written, all or nothing, when the stage ends."""
    out = Path(out_dir)
    return out.with_name(out.name + ".checkpoint.pt")


class StageCheckpoint:
    """A stage's state at a pause (``modules``' weights, the optimizer, the noise generator, the step, the time
    budget and the loss records), written all or nothing to ``checkpoint_path(config.out_dir)``; the same command
    run again resumes from it and, as the data order is replayed, trains as if it had never paused."""

    def __init__(
        self, config: StageConfig, stage: str, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer,
        noise_rng: torch.Generator, num_images: int,
    ) -> None:  # fmt: skip
        self.path = checkpoint_path(config.out_dir)
        self.stage, self.modules, self.optimizer, self.noise_rng = stage, modules, optimizer, noise_rng
        fields = json.loads(json.dumps(dataclasses.asdict(config), default=str))
        self.settings = {key: fields[key] for key in RESUME_KEYS if key in fields}
        self.settings["device_type"] = resolve_device(config.device).type  # CPU and CUDA generators differ
        self.num_images = num_images

    def load(self) -> dict | None:
        """The saved state, loaded into the modules, optimizer and generator; None where no checkpoint exists.
        A checkpoint of another stage, other settings or other data is refused in one line."""
        if not self.path.is_file():
            return None
        ckpt = load_checkpoint(self.path)
        if ckpt.get("stage") != self.stage:
            raise FastdiffError(f"{self.path} is a checkpoint of the {ckpt.get('stage')} stage, not the {self.stage}")
        for key, value in self.settings.items():
            if ckpt["settings"].get(key) != value:
                raise FastdiffError(
                    f"{self.path} was trained with {key}={ckpt['settings'].get(key)!r}, not {value!r}: use the same "
                    "settings, or delete it to start over"
                )
        if ckpt["num_images"] != self.num_images:
            raise FastdiffError(f"{self.path} was trained on {ckpt['num_images']} images, not {self.num_images}")
        for name, module in self.modules.items():
            module.load_state_dict(ckpt["modules"][name])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.noise_rng.set_state(ckpt["noise_rng"])
        log.info("%s stage: resumed from %s at step %d", self.stage, self.path, ckpt["step"])
        return ckpt

    def save(self, step: int, budget: Budget, records: list[dict]) -> Path:
        state = {
            "format": 1, "stage": self.stage, "settings": self.settings, "num_images": self.num_images, "step": step,
            "budget": budget.state(), "records": records, "optimizer": self.optimizer.state_dict(),
            "noise_rng": self.noise_rng.get_state(),
            "modules": {name: module.state_dict() for name, module in self.modules.items()},
        }  # fmt: skip
        save_checkpoint_atomic(state, self.path)
        log.info("%s stage: paused at step %d; the same command resumes from %s", self.stage, step, self.path)
        return self.path

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def load_split(config: StageConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from fastdiff.data import load_fashion_mnist

    return load_fashion_mnist(split, data_dir=config.data_dir, pad_to=IMAGE_SIZE)


def check_images(images: torch.Tensor, name: str) -> None:
    expected = (1, IMAGE_SIZE, IMAGE_SIZE)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise FastdiffError(f"{name} have shape {tuple(images.shape)}, expected [N, *{expected}]")
