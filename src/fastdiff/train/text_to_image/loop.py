"""What both stages train with: the device set-up, the data (Fashion-MNIST, padded) and its batches, the step
and time budget with its learning-rate schedule, the loss log, and the budgeted training loop itself (with
torch.compile's fallback to eager at the first step).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdiff.devices import resolve_device
from fastdiff.errors import FastdiffError
from fastdiff.train.text_to_image.config import IMAGE_SIZE, StageConfig
from fastdiff.train.trainer import REPORT_SECONDS

log = logging.getLogger(__name__)


class Budget:
    """Where a stage stands against ``max_steps`` and ``max_seconds`` (from ``start``), and its learning rate:
    linear warm-up over ``warmup_steps``, then a cosine from ``lr`` to ``lr * min_lr_ratio`` over the fraction
    of the budget used, by steps or by time, whichever is further along."""

    def __init__(self, config: StageConfig, start: float) -> None:
        self.config = config
        self.deadline = None if config.max_seconds is None else start + config.max_seconds
        self.loop_start = time.perf_counter()

    def progress(self, step: int) -> float:
        done = step / self.config.max_steps
        if self.deadline is not None:
            span = max(self.deadline - self.loop_start, 1e-9)
            done = max(done, (time.perf_counter() - self.loop_start) / span)
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


def run_first_step(step: Callable[[torch.Tensor], Any], batch: torch.Tensor, fallback: Callable[[], None]) -> Any:
    """``step(batch)``, the first training step; if it fails inside torch.compile, ``fallback()`` (switch to
    eager) and again."""
    try:
        return step(batch)
    except (FastdiffError, KeyboardInterrupt, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:  # Dynamo / Inductor errors surface at the first compiled call
        log.warning("torch.compile failed at the first step (%s: %s): training eagerly", type(exc).__name__, exc)
        fallback()
        return step(batch)


def epoch_batches(num: int, batch: int, generator: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Index batches of ``batch`` over ``num`` items, a new permutation each epoch (the remainder dropped)."""
    while True:
        order = torch.randperm(num, generator=generator).to(device)
        for b in range(num // batch):
            yield order[b * batch : (b + 1) * batch]


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
) -> tuple[int, str]:
    """The training loop of both stages: the budget's learning rate, one ``train_step`` per batch (the first one
    through ``run_first_step``, which falls back to ``eager`` if a compiled step fails), ``after_step(step)``
    (EMA), the loss log; stops at ``config.max_steps`` or when the time budget runs out. Returns (steps, why)."""
    step, stopped = 0, "max_steps"
    try:
        while step < config.max_steps:
            lr = budget.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = next_batch()
            values = run_first_step(train_step, batch, eager) if step == 0 else train_step(batch)
            if after_step is not None:
                after_step(step)
            step += 1
            out_of_time = budget.out_of_time() or budget.progress(step) >= 1.0
            loss_log.add(step, values, lr, last=step == config.max_steps or out_of_time)
            if out_of_time and step < config.max_steps:
                stopped = "max_seconds"
                break
    finally:
        loss_log.close()
    return step, stopped


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def load_split(config: StageConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from fastdiff.data import load_fashion_mnist

    return load_fashion_mnist(split, data_dir=config.data_dir, pad_to=IMAGE_SIZE)


def check_images(images: torch.Tensor, name: str) -> None:
    expected = (1, IMAGE_SIZE, IMAGE_SIZE)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise FastdiffError(f"{name} have shape {tuple(images.shape)}, expected [N, *{expected}]")
