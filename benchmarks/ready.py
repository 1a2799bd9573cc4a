"""Time to ready, in fresh processes, and whether they give the same bytes: the engine's load-to-first-image.

    python benchmarks/ready.py --model ddpm-cifar10 --batch 256 --plan plan.json --cold 2 --warm 5 --out ready.json
    python benchmarks/ready.py --model sd15 --system compile --cold 1 --warm 2 --out ready-compile.json

Each run is a new Python process (``--child``) that imports fastdiff, loads the model, samples one batch (the first
call: weight upload, kernel compile or load, the kernel plan or tuning, graph capture, the steps) and a second
one (the steady state), and prints its phases and a SHA-256 of each image's uint8 bytes. ``cold`` runs start with
empty Triton and fastdiff caches (a kernel plan still applies when ``--plan`` gives one); ``warm`` runs share
caches filled by one untimed run before them. ``--system compile`` times the same on the eager pipeline with the
U-Net under torch.compile (reduce-overhead, Inductor's cache emptied for cold runs), the fair baseline's ready time.
Text-to-image models sample ``--batch`` images of ``--prompt`` at ``--guidance``. The result gives best / worst /
mean of every phase per mode, and how many images differ between the runs (0: the same seed gave the same bytes in
every process; ``digests``: one per distinct set of images, to compare runs).

Python bytecode (``--bytecode``): each run imports torch and fastdiff from a bytecode cache of the measurement's own,
primed once, as on a pip install; a machine that sets ``PYTHONDONTWRITEBYTECODE`` (the lent H100s do) otherwise spends
~3 s of every process compiling their source. ``--bytecode as-set`` measures that instead.

A Stable Diffusion preset (sd15, sd21: random weights, fastdiff ships none) is written once, before the runs and
untimed, as a diffusers directory of fp16 safetensors (``--weights-dir``, default a temporary folder), and every run
loads it from there as a user's checkpoint would: the load phase is then a read, not the seconds the CPU spends
initialising 860 M random parameters (``--random-init`` times that instead).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

PHASES = (
    "import_s", "load_s", "first_forward_s", "plan_or_tune_s", "capture_s", "first_call_s", "to_first_image_s",
    "process_s", "call_ms", "step_ms",
)  # fmt: skip


def child(args: argparse.Namespace) -> None:
    import torch

    import fastdiff
    from fastdiff.devices import synchronize
    from fastdiff.pipelines.base import nonfinite_message

    t_import = time.perf_counter()
    torch.manual_seed(0)  # a preset without weights gets the same random weights in every process
    backend = "engine" if args.system == "engine" else "eager"
    pipe = fastdiff.Pipeline.from_pretrained(
        args.model, device="cuda", dtype=args.dtype, sampler=args.sampler, steps=args.steps, plan=args.plan,
        backend=backend,
    )  # fmt: skip
    if args.system == "compile":
        from fastdiff.bench.systems import COMPILE_CONFIGS, compile_model

        pipe.unet = compile_model(pipe.unet.to(pipe.device), COMPILE_CONFIGS["compile"])
    text = isinstance(pipe, fastdiff.TextToImagePipeline)

    def sample() -> torch.Tensor:
        if text:
            return pipe(
                [args.prompt], guidance_scale=args.guidance, height=args.height, width=args.width,
                num_images_per_prompt=args.batch, seeds=0, output_type="tensor", progress=False,
            )  # fmt: skip
        return pipe(batch_size=args.batch, seeds=0, output_type="tensor", progress=False)

    synchronize(pipe.device)
    t_load = time.perf_counter()
    images = sample()
    pixels = ((images.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()
    t_first = time.perf_counter()
    broken = nonfinite_message(images)  # a time to a broken image is no result
    if args.system == "compile":
        sample()  # reduce-overhead records its CUDA graphs on the second and third calls
        sample()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    sample()
    end.record()
    end.synchronize()
    timings = pipe.engine.timings if backend == "engine" else {}
    print(
        json.dumps(
            {
                "import_s": t_import - START,
                "load_s": t_load - t_import,
                "load_phases": getattr(pipe, "load_timings", None),
                "first_forward_s": timings.get("step_first_forward_s"),
                "plan_or_tune_s": timings.get("step_autotune_s"),
                "capture_s": timings.get("loop_s"),
                "first_call_s": t_first - t_load,
                "to_first_image_s": t_first - START,
                "call_ms": start.elapsed_time(end),
                "step_ms": start.elapsed_time(end) / args.steps,
                "ops_timed": timings.get("step_ops_timed"),
                "kernels": {k[len("step_kernels_") :]: v for k, v in timings.items() if k.startswith("step_kernels_")},
                "plan_sources": sorted(set(pipe.engine.plan_sources.values())) if backend == "engine" else [],
                "plan_digest": pipe.plan_digest if backend == "engine" else None,
                "nonfinite": broken,
                "image_sha256": [hashlib.sha256(p.numpy().tobytes()).hexdigest()[:16] for p in pixels],
                "imported": {name: name in sys.modules for name in ("transformers", "torch._dynamo")},
                "step_uploaded_gib": uploaded_gib(pipe) if backend == "engine" else None,
                "gpu_mib": {
                    "allocated": torch.cuda.memory_allocated() / 2**20,
                    "peak_allocated": torch.cuda.max_memory_allocated() / 2**20,
                    "reserved": torch.cuda.memory_reserved() / 2**20,
                },  # fmt: skip
            }
        )
    )


def uploaded_gib(pipe) -> float | None:
    """GiB of weights the engine's step model streamed to the device: each source tensor once, in the model's dtype
    (since git 0e5b53d; before it, every packed layout, in the engine's)."""
    step = pipe.engine.current_step_model
    streamer = getattr(getattr(step, "inner", step), "streamer", None)
    return None if streamer is None else streamer.bytes / 2**30


def saved_preset(model: str, weights_dir: Path | None) -> tuple[str, str | None]:
    """(what the runs load, how it was made): a random Stable Diffusion preset written once as a diffusers directory
    of fp16 safetensors (untimed; reused when ``weights_dir`` already holds it), any other model as it is."""
    from fastdiff.models.stable_diffusion import is_random_preset

    if not is_random_preset(model):
        return model, None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_reference import write_random_sd

    folder = Path(weights_dir or tempfile.mkdtemp(prefix=f"ready-{model}-")) / model
    if not (folder / "model_index.json").is_file():
        write_random_sd(folder, model)
    return str(folder), f"{model}'s random weights, written once as a diffusers directory (fp16) and read by each run"


def one_run(args: argparse.Namespace, env: dict[str, str], profile: Path | None = None) -> dict:
    """One child process's row; under cProfile, its statistics written to ``profile`` when given."""
    under = ["-m", "cProfile", "-o", str(profile)] if profile else []
    argv = [sys.executable, *under, __file__, "--child", "--model", args.model, "--batch", str(args.batch), "--dtype",
            args.dtype, "--sampler", args.sampler, "--steps", str(args.steps), "--system", args.system,
            "--prompt", args.prompt, "--guidance", str(args.guidance)]  # fmt: skip
    for flag in ("height", "width"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    if args.plan:
        argv += ["--plan", args.plan]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def write_profile_summary(profile: Path, top: int = 60) -> Path:
    """``profile``'s statistics as text beside it: the top functions by cumulative and by own time."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(str(profile), stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    out = profile.with_suffix(".txt")
    out.write_text(text.getvalue())
    return out


def bytecode_env(mode: str) -> dict[str, str]:
    """The runs' environment for Python bytecode ``mode`` (see ``--bytecode``): for "cached", a bytecode folder of
    this measurement's own (``PYTHONPYCACHEPREFIX``, writing allowed), primed by one untimed process that imports what
    a run imports first (torch, fastdiff and its engine and pipelines); modules a run imports later are cached by the
    first run."""
    env = dict(os.environ)
    if mode == "as-set":
        return env
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="ready-pycache-")
    prime = "import torch, fastdiff, fastdiff.engine, fastdiff.pipelines, fastdiff.bench.systems"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'src')!r}); {prime}"],
                   env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    return env


def describe_bytecode(mode: str) -> str:
    if mode == "as-set":
        where = "not written" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "as the environment has it"
        return f"as set: Python bytecode {where}"
    return "cached: a bytecode folder of the measurement's own, primed by one untimed import (as a pip install has)"


def summarize(rows: list[dict]) -> dict:
    out = {"runs": len(rows)}
    for phase in PHASES:
        values = [r[phase] for r in rows if r.get(phase) is not None]
        if values:
            out[phase] = {"best": min(values), "worst": max(values), "mean": statistics.fmean(values)}
    if not rows:
        return out
    out["plan_sources"] = sorted({s for r in rows for s in r["plan_sources"]})
    out["plan_digests"] = sorted({r["plan_digest"] or "" for r in rows})
    out["ops_timed"] = [r["ops_timed"] for r in rows]
    out["kernels"] = [r.get("kernels") for r in rows]  # the step's compiles: recorded, in workers, at launch
    out["nonfinite"] = [r.get("nonfinite") for r in rows]  # None: every value of the run's images finite
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="ddpm-cifar10")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--sampler", default="ddim")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--plan", default=None, help="kernel plan file given to every run (engine)")
    p.add_argument(
        "--system",
        default="engine",
        choices=("engine", "compile"),
        help="the engine, or the eager pipeline with its U-Net under torch.compile (reduce-overhead)",
    )
    p.add_argument("--prompt", default="a photo of a dress", help="text-to-image models: the prompt")
    p.add_argument("--guidance", type=float, default=7.5, help="text-to-image models: guidance scale")
    p.add_argument("--height", type=int, default=None, help="text-to-image models: image height")
    p.add_argument("--width", type=int, default=None, help="text-to-image models: image width")
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="SD presets: where their random weights are written once (default: a temporary folder)",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="SD presets: each run initialises the random weights instead of loading a saved directory",
    )
    p.add_argument(
        "--bytecode",
        default="cached",
        choices=("cached", "as-set"),
        help="Python bytecode: 'cached' (default) gives every run a bytecode cache of its own, primed by one "
        "untimed import, as a pip install has one; 'as-set': whatever the environment says (a machine that sets "
        "PYTHONDONTWRITEBYTECODE compiles torch's and fastdiff's source in every process)",
    )
    p.add_argument("--cold", type=int, default=1, help="runs with empty Triton and fastdiff caches")
    p.add_argument("--warm", type=int, default=5, help="runs with caches filled by one untimed run")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed runs, one more warm run under cProfile (not in the summary): its statistics go to "
        "PROFILE (.prof) and a text summary beside it (.txt)",
    )
    p.add_argument("--timeout", type=float, default=560)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from fastdiff.atomic import write_text_atomic
    from fastdiff.bench.env import environment

    loaded_from = None
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("child", "out")}
    if not args.random_init:  # the runs load the written folder; the result names the preset
        args.model, loaded_from = saved_preset(args.model, args.weights_dir)

    result = {"what": "time to ready and first image in fresh processes; image bytes compared across them",
              "config": config,
              "weights": loaded_from or "as the model name gives them (a file, a bundled model, or random init)",
              "env": environment(), "modes": {},
              "compile": {k: os.environ.get(f"FASTDIFF_COMPILE_{k.upper()}", "default")
                          for k in ("workers", "threads")}}  # fmt: skip
    bytecode = bytecode_env(args.bytecode)
    result["python_bytecode"] = describe_bytecode(args.bytecode)
    hashes = []
    for mode, runs in (("cold", args.cold), ("warm", args.warm)):
        if runs <= 0:
            continue
        shared = tempfile.mkdtemp(prefix="ready-")
        rows = []
        for i in range(runs + (mode == "warm")):
            where = shared if mode == "warm" else tempfile.mkdtemp(prefix="ready-cold-")
            env = {**bytecode, "TRITON_CACHE_DIR": f"{where}/triton", "FASTDIFF_CACHE_DIR": f"{where}/fastdiff",
                   "TORCHINDUCTOR_CACHE_DIR": f"{where}/inductor"}  # fmt: skip
            row = one_run(args, env)
            print(mode, i, {k: row[k] for k in ("to_first_image_s", "plan_or_tune_s", "step_ms", "plan_sources")},
                  flush=True)  # fmt: skip
            hashes.append(row.pop("image_sha256"))
            if mode == "warm" and i == 0:
                continue  # fills the caches
            rows.append(row)
        result["modes"][mode] = {"summary": summarize(rows), "rows": rows}
        if mode == "warm" and args.profile:  # caches as the warm runs had them
            args.profile.parent.mkdir(parents=True, exist_ok=True)
            row = one_run(args, env, profile=args.profile)
            hashes.append(row.pop("image_sha256"))
            result["profiled_run"] = {"row": row, "summary": write_profile_summary(args.profile).name}
    differing = sum(len(set(column)) > 1 for column in zip(*hashes, strict=True))
    digests = sorted({hashlib.sha256("".join(h).encode()).hexdigest()[:16] for h in hashes})
    result["images_differing_between_processes"] = {"images": len(hashes[0]), "processes": len(hashes),
                                                    "differing": differing, "digests": digests}  # fmt: skip
    print(json.dumps({m: v["summary"] for m, v in result["modes"].items()}, indent=1))
    print("images differing between processes:", result["images_differing_between_processes"])
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
