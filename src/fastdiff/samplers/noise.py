"""Seeded noise for sampling: image b's x_T and step noise are counter-based draws from ``seeds[b]``.

x_T is draw 0 and the noise of step i is draw i + 1 of ``fastdiff.kernels.philox_noise``: nothing is drawn up
front and nothing is stored, so memory does not grow with the number of steps, and image b depends on its own seed
only (any batch size, any number of GPUs). On CUDA the Triton kernel draws (the engine draws the step noise inside
its fused sampler step); on the CPU the plain-torch reference does. The integers are identical on both; the
normals agree to a few float32 ulps (the CPU and GPU maths libraries round log/cos/sin differently).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdiff.devices import host_to_device
from fastdiff.errors import FastdiffError
from fastdiff.kernels.philox_noise import gaussian_noise, gaussian_noise_ref

X_T_COUNTER = 0
"""The draw that gives x_T; step i uses draw ``i + 1``."""


MAX_SEED = 2**63 - 1


def seed_tensor(seeds: Sequence[int] | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Seeds as an int64 device vector; each must be an integer in 0..2^63 - 1 (checked on the host: a tensor
    already on a GPU is taken as it is, since reading it back would wait for the GPU). A list reaches a GPU by an
    asynchronous copy from pinned memory, so building the seeds of the next batch never waits for the current one."""
    if isinstance(seeds, torch.Tensor):
        if seeds.dtype.is_floating_point or seeds.dtype.is_complex or seeds.dtype == torch.bool:
            raise FastdiffError(f"seeds must be integers, got a {seeds.dtype} tensor")
        values = seeds.to(torch.int64).reshape(-1)
        if values.device.type == "cpu" and values.numel() and bool((values < 0).any()):
            raise FastdiffError(f"seeds must be in 0..{MAX_SEED}, got a negative seed")
        return values.to(device)
    values = list(seeds)
    for seed in values:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise FastdiffError(f"seeds must be integers in 0..{MAX_SEED}, got {seed!r}")
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def draw(seeds: torch.Tensor, counter: int, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 N(0, 1) noise [B, *shape] on ``seeds``' device: draw ``counter`` of each image's seed."""
    if seeds.device.type == "cuda":
        return gaussian_noise(seeds, counter, shape)
    return gaussian_noise_ref(seeds, counter, shape)


def initial_noise(
    seeds: Sequence[int] | torch.Tensor, shape: tuple[int, ...], device: torch.device | str
) -> torch.Tensor:
    """Unit-variance x_T [B, *shape] (fp32) for ``seeds`` (a list, or :func:`seed_tensor`'s vector)."""
    return draw(seed_tensor(seeds, device), X_T_COUNTER, shape)


def step_noise(seeds: torch.Tensor, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The noise z of sampler step ``step`` [B, *shape] (fp32)."""
    return draw(seeds, step + 1, shape)
