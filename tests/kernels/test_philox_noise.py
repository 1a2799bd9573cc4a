"""Counter-based Gaussian noise: the Triton kernel against the plain-torch Philox, and the noise's properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.philox_noise import gaussian_noise, gaussian_noise_ref, philox4x32_ref

from .conftest import DEVICE

PHILOX_KNOWN_ANSWERS = [
    # Random123's kat_vectors for philox4x32_10: (counter, key) -> output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_ref_matches_random123_known_answers(counter, key, expected) -> None:
    bits = key[0] | (key[1] << 32)
    seed = torch.tensor(bits - 2**64 if bits >= 2**63 else bits)  # the 64 key bits as an int64
    got = philox4x32_ref(seed, *(torch.tensor(c) for c in counter))
    assert tuple(int(v) for v in got) == expected


@pytest.mark.parametrize(
    "shape, channels_last",
    [((3, 5, 7), False), ((3, 5, 7), True), ((1, 9, 2), True), ((4, 1, 1), False), ((2, 6), False)],
    ids=["c3_5x7", "c3_5x7_nhwc", "c1_9x2_nhwc", "c4_1x1", "rank3"],
)
def test_kernel_matches_ref(shape, channels_last) -> None:
    if channels_last and len(shape) != 3:
        pytest.skip("channels-last needs images")
    seeds = torch.tensor([0, 1, 2**40 + 17, 2**63 - 1], dtype=torch.int64, device=DEVICE)
    out = torch.full((4, *shape), float("nan"), device=DEVICE)
    if channels_last:
        out = out.contiguous(memory_format=torch.channels_last)
    got = gaussian_noise(seeds, 11, shape, out=out)
    ref = gaussian_noise_ref(seeds, 11, shape)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)  # a few ulps: log/cos/sin differ by library


def test_image_depends_on_its_seed_and_counter_only() -> None:
    seeds = torch.tensor([3, 9, 3], device=DEVICE)
    batch = gaussian_noise_ref(seeds, 2, (2, 4, 4))
    assert torch.equal(batch[0], batch[2]) and not torch.equal(batch[0], batch[1])
    assert torch.equal(gaussian_noise_ref(seeds[1:2], 2, (2, 4, 4))[0], batch[1])
    assert not torch.equal(gaussian_noise_ref(seeds, 3, (2, 4, 4)), batch)


def test_noise_is_standard_normal() -> None:
    draws = gaussian_noise_ref(torch.arange(8), 1, (64, 64)).flatten().numpy()
    assert abs(draws.mean()) < 0.01 and abs(draws.std() - 1) < 0.01
    # a normal's quantiles: 2.5 % and 97.5 % at -1.96 / 1.96
    lo, hi = np.quantile(draws, [0.025, 0.975])
    assert abs(lo + 1.96) < 0.03 and abs(hi - 1.96) < 0.03
    assert np.isfinite(draws).all()


def test_bad_seeds_raise() -> None:
    with pytest.raises(FastdiffError, match="int64"):
        gaussian_noise(torch.zeros(2, dtype=torch.int32, device=DEVICE), 0, (3,))
