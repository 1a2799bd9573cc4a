"""fastdiff: diffusion U-Net sampling as fast as the GPU allows, measured against diffusers and torch.compile."""

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet
from fastdiff.pipelines import Pipeline, TextToImagePipeline

__all__ = ["FastdiffError", "Pipeline", "TextToImagePipeline", "load_unet"]
__version__ = "0.1.0"
