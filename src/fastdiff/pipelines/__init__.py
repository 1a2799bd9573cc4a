"""The two pipelines: ``Pipeline`` (unconditional pixel U-Nets; its ``from_pretrained`` also opens text-to-image
directories) and ``TextToImagePipeline`` (Stable Diffusion-format directories), on a shared base."""

from fastdiff.pipelines.base import BACKENDS, DTYPE_NAMES, FP8, check_fp8, resolve_backend
from fastdiff.pipelines.text_to_image import TextToImagePipeline, is_text_to_image_dir
from fastdiff.pipelines.unconditional import Pipeline, sample_loop

__all__ = [
    "BACKENDS",
    "DTYPE_NAMES",
    "FP8",
    "Pipeline",
    "TextToImagePipeline",
    "check_fp8",
    "is_text_to_image_dir",
    "resolve_backend",
    "sample_loop",
]
