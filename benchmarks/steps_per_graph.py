"""How many sampling steps one CUDA graph should hold: capture time against the time of a whole sampling call.

    python benchmarks/steps_per_graph.py --model sd15 --batch 1 --per-graph 1,2,5,20 --out steps-per-graph.json

One process, the engine, the model's shipped kernel plan. For each K of ``--per-graph`` the engine's sampling loop
is prepared again with K steps per graph (an N-step call replays the K-step graph N // K times and an N % K-step
graph once): the result gives the capture time of that loop (``loop_s``, what every fresh process pays once) and the
median over ``--repeats`` calls of a whole sampling call (CUDA events, after 2 warm-ups; text-to-image calls include
the text encoder and the VAE decode, as a user's call does). Every K must give the same image bytes: the graphs hold
the same kernels in the same order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sd15")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--per-graph", default="1,2,5,20", help="comma-separated steps per graph to compare")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--prompt", default="a photo of a dress")
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--weights-dir", type=Path, default=None, help="SD presets: where their random weights go")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    per_graph = [int(k) for k in args.per_graph.split(",")]

    import torch
    from ready import saved_preset

    import fastdiff
    from fastdiff.atomic import write_text_atomic
    from fastdiff.bench.env import environment
    from fastdiff.devices import synchronize, time_ms
    from fastdiff.images import uint8_pixels

    model, loaded_from = saved_preset(args.model, args.weights_dir)
    torch.manual_seed(0)  # a preset without weights: the same random weights as ready.py's runs
    pipe = fastdiff.Pipeline.from_pretrained(model, device="cuda", dtype=args.dtype, steps=args.steps, backend="engine")
    text = isinstance(pipe, fastdiff.TextToImagePipeline)

    def sample() -> torch.Tensor:
        if text:
            return pipe([args.prompt], guidance_scale=args.guidance, num_images_per_prompt=args.batch, seeds=0,
                        output_type="tensor", progress=False)  # fmt: skip
        return pipe(batch_size=args.batch, seeds=0, output_type="tensor", progress=False)

    sample()  # kernels loaded or compiled, weights uploaded: every K below starts from the same state
    rows = []
    for k in per_graph:
        pipe.engine.steps_per_graph = k
        pipe.engine.loops.clear()
        synchronize(pipe.device)
        t0 = time.perf_counter()
        images = sample()
        synchronize(pipe.device)
        first_call_s = time.perf_counter() - t0
        for _ in range(2):
            sample()
        calls = [time_ms(sample, pipe.device) for _ in range(args.repeats)]
        pixels = uint8_pixels(images).cpu()  # as the PNG writers make them
        row = {
            "steps_per_graph": k,
            "capture_s": pipe.engine.timings.get("loop_s"),
            "first_call_s": first_call_s,
            "call_ms": statistics.median(calls),
            "call_ms_all": calls,
            "image_sha256": hashlib.sha256(pixels.numpy().tobytes()).hexdigest()[:16],
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "call_ms_all"}), flush=True)
    result = {
        "what": "steps per CUDA graph: the loop's capture time against the median time of a whole sampling call",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "weights": loaded_from or "as the model name gives them",
        "env": environment(),
        "rows": rows,
        "same_bytes_for_every_k": len({r["image_sha256"] for r in rows}) == 1,
    }
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
