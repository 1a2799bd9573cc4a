"""Images with NaN or inf are said so: ``nonfinite_message`` counts them, and a pipeline that converts such images for
the host (PIL, NumPy) logs one warning (they would be written as black PNGs with no other sign)."""

from __future__ import annotations

import logging

import torch

from fastdiff import Pipeline
from fastdiff.pipelines.base import nonfinite_message


def test_nonfinite_message_counts_nan_and_inf():
    assert nonfinite_message(torch.zeros(2, 3)) is None
    images = torch.zeros(2, 3, 4, 4)
    images[0, 0, 0, :2] = float("nan")
    images[1, 2, 3, 3] = float("-inf")
    assert nonfinite_message(images) == "non-finite output: 3 of 96 values are NaN or inf"


def test_a_pipeline_warns_when_its_images_are_not_finite(caplog):
    pipe = Pipeline.from_pretrained("fashion-mnist", device="cpu", steps=1)
    with caplog.at_level(logging.WARNING, logger="fastdiff.pipelines.base"):
        pipe(batch_size=2, seeds=0, output_type="np", progress=False)
        assert not caplog.records  # a healthy model: nothing said
        with torch.no_grad():
            next(p for name, p in pipe.unet.named_parameters() if name.endswith("bias")).fill_(float("nan"))
        pipe(batch_size=2, seeds=0, output_type="np", progress=False)
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("non-finite output: ")
    assert "(backend eager, float32): the images are broken; try another dtype, or backend='eager'" in message
