"""Generation parameters in every PNG fastdiff writes, from one place (``fastdiff.images.png_info``): sample's
(tests/test_cli.py), generate's and the service's; a seed's PNG does not depend on what it was batched with."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image

import fastdiff
from fastdiff.generate import GenerateConfig, Unit, image_parameters, start_writes
from fastdiff.images import png_bytes
from fastdiff.serve.schema import ResolvedRequest


def read_parameters(data: bytes | Path) -> dict:
    image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    return json.loads(image.text["parameters"])


def test_png_bytes_carry_the_parameters_and_the_version():
    image = Image.new("L", (5, 3), 7)
    params = read_parameters(png_bytes(image, {"model": "m", "seed": 4, "prompt": "ein Kleid, rot"}))
    assert params == {"model": "m", "seed": 4, "prompt": "ein Kleid, rot", "fastdiff": fastdiff.__version__}
    assert "parameters" not in Image.open(io.BytesIO(png_bytes(image))).text


def test_generate_writes_each_seed_with_its_parameters(tmp_path):
    config = GenerateConfig(model="tiny", num_images=3, out_dir=tmp_path, sampler="unipc", steps=7, dtype="fp16")
    images = torch.linspace(-1, 1, 3 * 1 * 4 * 6).reshape(3, 1, 4, 6)
    with ThreadPoolExecutor(2) as pool:
        assert start_writes(pool, tmp_path, Unit(10, 13), images, "png", image_parameters(config)).wait() == 3
    for seed in (10, 11, 12):
        params = read_parameters(tmp_path / f"{seed:06d}.png")
        assert params == {"model": "tiny", "sampler": "unipc", "steps": 7, "dtype": "fp16", "seed": seed,
                          "fastdiff": fastdiff.__version__}  # fmt: skip


def test_service_parameters_are_per_image_and_batch_independent():
    common = dict(steps=5, sampler="ddim", prompt="a dress", negative_prompt=None, guidance=3.0, size=(32, 32))
    alone = ResolvedRequest(seeds=[8], **common).image_parameters("fashion-mnist-t2i")
    batched = ResolvedRequest(seeds=[7, 8, 9], **common).image_parameters("fashion-mnist-t2i")
    assert alone[0] == batched[1]
    assert batched[1] == {"model": "fashion-mnist-t2i", "steps": 5, "sampler": "ddim", "prompt": "a dress",
                          "guidance": 3.0, "size": [32, 32], "seed": 8}  # fmt: skip
    image = Image.new("RGB", (4, 4))
    assert png_bytes(image, alone[0]) == png_bytes(image, batched[1])
