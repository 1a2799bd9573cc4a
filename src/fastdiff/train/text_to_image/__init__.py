"""A text-to-image model of Fashion-MNIST in Stable Diffusion's own directory format, trained in two stages.

Stage ``vae`` trains a diffusers-config ``AutoencoderKL`` (32x32x1 images in [-1, 1] <-> 8x8x4 latents: three
levels, so 4 pixels per latent) with an L1 + L2 reconstruction loss and a small KL term, sets ``scaling_factor``
to 1 / the latent std of the training set (as SD's 0.18215 was chosen) and writes ``OUT/vae/`` (diffusers
format, fp16) with ``summary.json`` (test-set PSNR), ``loss.jsonl``, ``loss.png`` and ``reconstructions.png``.

Stage ``unet`` loads that VAE, encodes the training set once, and trains a CLIP text encoder
(``fastdiff.models.clip_text``, on a local tokenizer whose vocabulary holds every prompt word whole) jointly with a
``UNet2DConditionModel`` on the latents: epsilon prediction on SD's scaled-linear schedule, 10% empty prompts for
classifier-free guidance, min-SNR loss weights and an EMA of both networks. It writes a complete
``StableDiffusionPipeline`` directory (fp16 safetensors) that ``fastdiff.TextToImagePipeline`` and diffusers
both load, then samples it: ``samples.png`` (one row per class) and, in ``summary.json``, the bundled
classifier's accuracy on the generated images and their FD-FMNIST.

Each stage stops at ``max_steps`` or when ``max_seconds`` (counted from the stage's start) run out; the learning
rate decays on a cosine over whichever budget ends first, so a time-bound run still anneals. Output folders are
written all or nothing (``fastdiff.atomic.write_folder_atomic``).

Modules, each importing only those above it:

* ``prompts``: the class prompts and the CLIP tokenizer built on their words.
* ``config``: the architecture presets, SD's training schedule, the stage configs and their checks.
* ``files``: what the stages write (diffusers model folders, the pipeline directory and its model_index.json).
* ``loop``: what both stages train with (device, data, step/time budget, loss log, the budgeted loop).
* ``vae_stage``: stage 1, ``train_vae``.
* ``unet_stage``: stage 2, ``train_text_to_image`` (and the sampling of the written pipeline).

Stages do not resume: each runs from scratch to its budget and writes its folder once, at the end.
"""

from fastdiff.train.text_to_image.config import (
    PRESETS,
    SCHEDULER_CONFIG,
    StageConfig,
    TextToImagePreset,
    UNetStageConfig,
    VAEStageConfig,
    resolve_preset,
)
from fastdiff.train.text_to_image.files import MODEL_INDEX
from fastdiff.train.text_to_image.prompts import (
    CLASS_NOUNS,
    EMPTY_PROMPT,
    build_tokenizer,
    canonical_prompts,
    class_prompts,
    noun_phrase,
    prompt_table,
    random_prompt,
    tokenize,
    tokenizer_files,
)
from fastdiff.train.text_to_image.unet_stage import train_text_to_image
from fastdiff.train.text_to_image.vae_stage import train_vae

__all__ = [
    "CLASS_NOUNS",
    "EMPTY_PROMPT",
    "MODEL_INDEX",
    "PRESETS",
    "SCHEDULER_CONFIG",
    "StageConfig",
    "TextToImagePreset",
    "UNetStageConfig",
    "VAEStageConfig",
    "build_tokenizer",
    "canonical_prompts",
    "class_prompts",
    "noun_phrase",
    "prompt_table",
    "random_prompt",
    "resolve_preset",
    "tokenize",
    "tokenizer_files",
    "train_text_to_image",
    "train_vae",
]
