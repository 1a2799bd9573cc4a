"""Seeded starting noise and per-step noise: one generator per image, so an image depends on its seed only."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def draw_noise(
    seeds: Sequence[int],
    sample_shape: tuple[int, ...],
    num_steps_with_noise: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x_T of shape [B, *sample_shape] and step noise [N, B, *sample_shape] (None when N == 0).

    Sample b draws ``1 + N`` standard normals in one call from ``torch.Generator(device).manual_seed(seeds[b])``:
    the first is x_T, the rest the noise of steps 0..N-1. All of it is drawn before sampling starts, so the
    sampling loop itself draws nothing (it can be captured in one CUDA graph).
    """
    device = torch.device(device)
    draws = []
    for seed in seeds:
        gen = torch.Generator(device=device).manual_seed(int(seed))
        draws.append(torch.randn((1 + num_steps_with_noise, *sample_shape), generator=gen, device=device))
    stacked = torch.stack(draws, dim=1).to(dtype)  # [1 + N, B, ...]
    x_t = stacked[0].contiguous()
    noise = stacked[1:].contiguous() if num_steps_with_noise > 0 else None
    return x_t, noise
