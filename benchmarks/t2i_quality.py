"""Quality of a text-to-image model on Fashion-MNIST prompts: conditional accuracy and FD-FMNIST per (guidance,
sampler, steps, backend/dtype).

For each configuration, ``--per-class`` images of each class's canonical prompt ("a photo of an ankle boot", ...)
are sampled (image k of class c: seed ``SEED + c * per_class + k``, the same in every configuration); the
conditional accuracy is the share that the bundled Fashion-MNIST classifier assigns to the prompt's class, and
FD-FMNIST compares all of them with the 10,000 test images (at least 500 images are needed for an FD).

    python benchmarks/t2i_quality.py --out benchmarks/results/t2i-quality-fashion-mnist-t2i-h100.json \\
        --per-class 1000 --guidance 1,2,3,5 --samplers dpmsolver++,euler,unipc,ddim --steps 10,20 \\
        --systems engine-fp16,engine-bf16 --device cuda

``--intervals 0:1,0.2:0.8`` adds guidance intervals (``guidance_interval``) as another axis of the grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fastdiff.atomic import check_output_location, write_text_atomic  # noqa: E402
from fastdiff.bench.env import environment  # noqa: E402
from fastdiff.data import load_fashion_mnist  # noqa: E402
from fastdiff.errors import FastdiffError  # noqa: E402
from fastdiff.generate import hash_model_files  # noqa: E402
from fastdiff.models.stable_diffusion import load_stable_diffusion, resolve_pipeline_dir  # noqa: E402
from fastdiff.pipelines.text_to_image import TextToImagePipeline  # noqa: E402
from fastdiff.quality.classifier import classifier_accuracy, fd_fmnist, load_classifier  # noqa: E402
from fastdiff.samplers import FULL_GUIDANCE, check_guidance_interval  # noqa: E402
from fastdiff.train.text_to_image import canonical_prompts  # noqa: E402
from fastdiff.train.text_to_image.vae_stage import reconstruction_fd  # noqa: E402

log = logging.getLogger("t2i_quality")
SEED = 10**6
FD_MIN_IMAGES = 500


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def interval(text: str) -> tuple[float, float]:
    """ "START:STOP" (fractions of the steps; see ``guidance_interval``) as a pair of floats."""
    start, _, stop = text.partition(":")
    return check_guidance_interval((start, stop))


def sample_class_images(
    pipe: TextToImagePipeline, per_class: int, guidance: float, sampler: str, steps: int,
    guidance_interval: tuple[float, float] = FULL_GUIDANCE,
):  # fmt: skip
    """[10 * per_class, C, H, W] images in [-1, 1] (class-major) and their labels."""
    prompts = canonical_prompts()
    images = [
        pipe(prompt, num_images_per_prompt=per_class, seeds=SEED + c * per_class, guidance_scale=guidance,
             sampler=sampler, steps=steps, output_type="tensor", progress=False,
             guidance_interval=guidance_interval).float().cpu()
        for c, prompt in enumerate(prompts)
    ]  # fmt: skip
    return torch.cat(images), torch.arange(len(prompts)).repeat_interleave(per_class)


@torch.no_grad()
def floors(model: str, images: int, data_dir: Path | None, device: str, classifier) -> dict:
    """What no sampler can beat: FD-FMNIST of ``images`` real training images and of their VAE reconstructions
    (posterior mean, decoded, clamped) against the test set, and the classifier's accuracy on the real test images."""
    train, _ = load_fashion_mnist("train", data_dir)
    train = train[:images]
    vae = load_stable_diffusion(model, device=device).vae.eval()
    test, test_labels = load_fashion_mnist("test", data_dir)
    return {
        "images": train.shape[0],
        "fd_fmnist_real_train": fd_fmnist(train, "test", data_dir=data_dir, device=device),
        "fd_fmnist_vae_reconstructions": reconstruction_fd(vae, train, torch.device(device), data_dir),
        "classifier_accuracy_real_test": classifier_accuracy(classifier, test, test_labels),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="fashion-mnist-t2i")
    parser.add_argument("--out", type=Path, required=True, help="the JSON result (written after every row)")
    parser.add_argument("--per-class", type=int, default=1000, help="images per class prompt")
    parser.add_argument("--guidance", type=csv(float), default=[1.0, 2.0, 3.0, 5.0])
    parser.add_argument("--samplers", type=csv(str), default=["dpmsolver++", "euler", "unipc", "ddim"])
    parser.add_argument("--steps", type=csv(int), default=[10, 20])
    parser.add_argument(
        "--intervals",
        type=csv(interval),
        default=[FULL_GUIDANCE],
        help="guidance intervals START:STOP in fractions of the steps, comma-separated (default 0:1: every step)",
    )
    parser.add_argument("--systems", type=csv(str), default=["engine-fp16"], help="<eager|engine>-<dtype>")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--data-dir", type=Path, default=None, help="Fashion-MNIST folder (default: Debian's)")
    parser.add_argument(
        "--floor",
        type=int,
        default=0,
        metavar="N",
        help="also measure the floors on N training images (FD-FMNIST of the real images and of "
        "their VAE reconstructions; the classifier's accuracy on the real test set)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.per_class <= 0:
        raise FastdiffError(f"--per-class must be positive, got {args.per_class}")
    if args.floor < 0:
        raise FastdiffError(f"--floor must be >= 0, got {args.floor}")
    check_output_location(args.out, "--out")
    classifier = load_classifier(device=args.device)
    result = {"env": environment(), "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "weights_sha256": hash_model_files(resolve_pipeline_dir(args.model), (".safetensors",)),
              "results": []}  # fmt: skip
    if args.floor:
        result["floor"] = floors(args.model, args.floor, args.data_dir, args.device, classifier)
        log.info("floor: %s", result["floor"])
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    for system in args.systems:
        backend, _, dtype = system.rpartition("-")
        pipe = TextToImagePipeline.from_pretrained(args.model, device=args.device, dtype=dtype, backend=backend)
        for sampler in args.samplers:
            for steps in args.steps:
                for guidance, span in itertools.product(args.guidance, args.intervals):
                    if span != FULL_GUIDANCE and guidance <= 1:
                        continue  # no guidance: the interval changes nothing
                    start = time.perf_counter()
                    images, labels = sample_class_images(pipe, args.per_class, guidance, sampler, steps, span)
                    seconds = time.perf_counter() - start
                    row = dict(system=system, sampler=sampler, steps=steps, guidance=guidance,
                               images=images.shape[0], seconds=seconds,
                               accuracy=classifier_accuracy(classifier, images, labels))  # fmt: skip
                    if span != FULL_GUIDANCE:
                        row["guidance_interval"] = list(span)
                    if images.shape[0] >= FD_MIN_IMAGES:
                        row["fd_fmnist"] = fd_fmnist(images, "test", data_dir=args.data_dir, device=args.device)
                    log.info("%s", row)
                    result["results"].append(row)
                    write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
