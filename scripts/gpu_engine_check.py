"""One-shot GPU check of the engine (run on the H100 from the repo root, not installed):

    PYTHONPATH=src python3 scripts/gpu_engine_check.py

Sections (each caught and reported on its own, so one failure keeps the rest):
  1. the engine tests that need CUDA (graph replay == eager, fused vs eager model, streamed weights);
  2. quality: engine fp16 vs our eager fp32, ddpm-cifar10 random weights, DDIM 100 steps, same x_T (PSNR);
  3. timing, ddpm-cifar10 DDPM-1000 schedule, batch 1 and 256 (CUDA events, warm-up, median of repeats):
     our eager fp16 loop, the engine with the eager model in one graph ("engine-eagerunet"), the fused engine;
     time to ready (build: streamed weights + first forward + per-layer timing; capture), plan peak bytes;
  4. steps per graph K: capture seconds and ms/step at batch 1 for several K (K = 1000: the whole loop);
  5. one full 1000-step DDPM run at batch 1 (s/image) and per-layer choice tables.
Writes $OUT/engine_check.json (and the layer tables); prints a summary table last.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

START = time.perf_counter()
BUDGET_S = 420.0  # stop starting new sections after this (the lead's limit is 8 minutes)
OUT = Path(os.environ.get("OUT", "engine_check_out"))
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict = {"sections": {}, "errors": {}}


def elapsed() -> float:
    return time.perf_counter() - START


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            if elapsed() > BUDGET_S:
                RESULTS["errors"][name] = f"skipped: {elapsed():.0f} s elapsed"
                print(f"[{name}] skipped (time budget)", flush=True)
                return None
            t0 = time.perf_counter()
            print(f"[{name}] start at {elapsed():.0f} s", flush=True)
            try:
                out = fn(*args, **kwargs)
                RESULTS["sections"][name] = out
                return out
            except Exception as exc:
                RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                return None
            finally:
                print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
                save()

        return run

    return wrap


def save() -> None:
    (OUT / "engine_check.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def cuda_ms(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def make_model():
    from fastdiff.models.ddpm_unet import DDPM_PRESETS, DDPMUNet

    torch.manual_seed(0)
    return DDPMUNet(DDPM_PRESETS["ddpm-cifar10"]).eval()


def inputs(batch: int, steps: int, sampler):
    from fastdiff.samplers.noise import draw_noise

    return draw_noise(list(range(batch)), (3, 32, 32), steps if sampler.needs_noise else 0, "cuda")


@section("env")
def env() -> dict:
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


@section("tests")
def tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "tests/engine/test_graph.py", "tests/engine/test_weights.py", "tests/engine/test_fused_unet.py"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": "src"})
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"returncode": proc.returncode, "tail": tail}


@section("quality")
def quality() -> dict:
    from fastdiff.engine import Engine
    from fastdiff.pipeline import sample_loop
    from fastdiff.quality.psnr import psnr
    from fastdiff.samplers import ScheduleConfig, make_sampler

    model = make_model()
    sampler = make_sampler("ddim", ScheduleConfig(), 100, device="cuda")
    x_t, _ = inputs(8, 0, sampler)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # a true fp32 reference
    with torch.no_grad():
        ref = sample_loop(model.cuda(), sampler, x_t.clone(), None, torch.float32)
    torch.backends.cudnn.allow_tf32 = tf32
    out = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        engine = Engine("cuda")
        engine.prepare(make_model(), sampler, 8, dtype)
        got = engine.run(x_t, None).clamp(-1, 1)
        out[name] = {
            "psnr_db_mean": float(psnr(got, ref).mean()),
            "psnr_db_min": float(psnr(got, ref).min()),
            "max_abs_diff": float((got - ref).abs().max()),
            "finite": bool(torch.isfinite(got).all()),
        }
    return out


def time_loop_eager(model, sampler, x_t, noise, steps, repeats) -> float:
    """Our eager fp16 loop (channels-last model, torch sampler step): median ms/step."""
    batch = x_t.shape[0]

    def run():
        x, x0 = x_t.clone(), None
        with torch.no_grad():
            for i in range(steps):
                out = model(x.to(torch.float16), sampler.timesteps[i].expand(batch)).float()
                x, x0 = sampler.step(i, x, out, x0, None if noise is None else noise[i])

    run()
    return statistics.median(cuda_ms(run, repeats)) / steps


def engine_ms_per_step(engine, x_t, noise, steps: int, repeats: int) -> float:
    return statistics.median(cuda_ms(lambda: engine.run(x_t, noise, steps), repeats)) / steps


@section("timing")
def timing() -> dict:
    from fastdiff.engine import Engine
    from fastdiff.samplers import ScheduleConfig, make_sampler

    sampler = make_sampler("ddpm", ScheduleConfig(), 1000, device="cuda")
    results = {}
    for batch, steps, repeats in ((1, 200, 5), (256, 20, 3)):
        row: dict = {}
        x_t, noise = inputs(batch, 1000, sampler)
        eager = make_model().to("cuda", torch.float16).to(memory_format=torch.channels_last)
        row["eager_fp16_ms"] = time_loop_eager(eager, sampler, x_t, noise, 10 if batch > 1 else 30, 3)
        del eager
        for label, impl in (("engine_eagerunet", "eager"), ("engine", "fused")):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            engine = Engine("cuda", unet_impl=impl)
            model = make_model()
            engine.prepare(model, sampler, batch, torch.float16)
            torch.cuda.synchronize()
            row[f"{label}_ready_s"] = time.perf_counter() - t0
            row[f"{label}_timings"] = dict(engine.timings)
            engine.run(x_t, noise, steps)  # warm
            row[f"{label}_ms"] = engine_ms_per_step(engine, x_t, noise, steps, repeats)
            row[f"{label}_peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
            if impl == "fused":
                fused = engine.step_models[(id(model), batch, torch.float16)]
                row["plan_peak_mb"] = fused.plan.peak_bytes / 2**20
                row["plan_no_reuse_mb"] = fused.plan.total_bytes / 2**20
                row["launches_per_step"] = fused.num_launches + 3  # + cast, noise select, sampler step
                table = fused.layer_table()
                row["sum_of_op_us"] = sum(min(r["times_us"].values()) for r in table if r["times_us"])
                (OUT / f"layers_b{batch}.json").write_text(json.dumps(table, indent=1) + "\n")
                chosen: dict = {}
                for r in table:
                    chosen.setdefault(r["kind"], {}).setdefault(r["impl"], 0)
                    chosen[r["kind"]][r["impl"]] += 1
                row["choices"] = chosen
                # warm time to ready: a second engine in this process (kernels compiled, cuDNN/cuBLAS up)
                t0 = time.perf_counter()
                again = Engine("cuda")
                again.prepare(make_model(), sampler, batch, torch.float16)
                torch.cuda.synchronize()
                row["engine_ready_warm_s"] = time.perf_counter() - t0
                row["engine_ready_warm_timings"] = dict(again.timings)
                del again
            del engine
            torch.cuda.empty_cache()
        row["images_per_s_engine"] = batch / (row["engine_ms"] * 1e-3 * 1000)
        results[f"b{batch}"] = row
        print(json.dumps(row, default=str)[:1500], flush=True)
    return results


@section("steps_per_graph")
def steps_per_graph() -> dict:
    from fastdiff.engine import Engine
    from fastdiff.samplers import ScheduleConfig, make_sampler

    sampler = make_sampler("ddpm", ScheduleConfig(), 1000, device="cuda")
    x_t, noise = inputs(1, 1000, sampler)
    model = make_model()
    out = {}
    base = Engine("cuda", steps_per_graph=10)
    base.prepare(model, sampler, 1, torch.float16)
    fused = base.step_models[(id(model), 1, torch.float16)]
    from fastdiff.engine.graph import SamplingLoop

    for k in (10, 50, 200, 1000):
        if elapsed() > BUDGET_S:
            out[f"K{k}"] = "skipped (time budget)"
            continue
        loop = SamplingLoop(fused.bind_timesteps(sampler.timesteps), sampler, (1, 3, 32, 32), torch.float16,
                            torch.device("cuda"), steps_per_graph=k)  # fmt: skip
        loop.load(x_t, noise)
        loop.capture(k)
        loop.run(x_t, noise, k)
        ms = statistics.median(cuda_ms(lambda loop=loop, k=k: loop.run(x_t, noise, k), 3)) / k
        out[f"K{k}"] = {"capture_s": loop.capture_seconds[k], "ms_per_step": ms}
        del loop
    return out


@section("full_run_b1")
def full_run() -> dict:
    from fastdiff.engine import Engine
    from fastdiff.samplers import ScheduleConfig, make_sampler

    sampler = make_sampler("ddpm", ScheduleConfig(), 1000, device="cuda")
    x_t, noise = inputs(1, 1000, sampler)
    engine = Engine("cuda")
    engine.prepare(make_model(), sampler, 1, torch.float16)
    engine.run(x_t, noise)
    times = cuda_ms(lambda: engine.run(x_t, noise), 3)
    return {"s_per_image": statistics.median(times) / 1e3, "all_ms": times}


def summary() -> None:
    s, e = RESULTS["sections"], RESULTS["errors"]
    print("\n==== engine check summary ====")
    if s.get("tests"):
        print(f"tests: rc={s['tests']['returncode']} {s['tests']['tail'][-1] if s['tests']['tail'] else ''}")
    for name, q in (s.get("quality") or {}).items():
        print(f"quality {name}: PSNR mean {q['psnr_db_mean']:.1f} dB, min {q['psnr_db_min']:.1f} dB (target >= 40)")
    cols = ("eager_fp16_ms", "engine_eagerunet_ms", "engine_ms", "images_per_s_engine", "engine_ready_s",
            "engine_ready_warm_s", "plan_peak_mb")  # fmt: skip
    heads = ("eager16", "eng-eager", "engine", "img/s", "ready", "warm", "planMB")
    print(f"{'batch':>5} " + " ".join(f"{h:>9}" for h in heads))
    for key, row in (s.get("timing") or {}).items():
        vals = [row.get(c, float("nan")) for c in cols]
        print(f"{key:>5} " + " ".join(f"{v:9.3f}" for v in vals))
    print("(ms/step; targets: b1 engine <= 0.5 ms/step, b256 >= 30 img/s, warm ready <= 5 s)")
    for key, val in (s.get("steps_per_graph") or {}).items():
        print(f"graph {key}: {val}")
    if s.get("full_run_b1"):
        print(f"full DDPM-1000 b1: {s['full_run_b1']['s_per_image']:.3f} s/image (target <= 0.5)")
    for name, err in e.items():
        print(f"ERROR {name}: {err[:300]}")
    print(f"total {elapsed():.0f} s; JSON in {OUT}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    env()
    tests()
    timing()
    quality()
    steps_per_graph()
    full_run()
    save()
    summary()
