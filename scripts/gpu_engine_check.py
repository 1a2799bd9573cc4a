"""One-shot GPU check of the engine (run on the H100 from the repo root, not installed):

    PYTHONPATH=src python3 scripts/gpu_engine_check.py

Sections, most important first (each caught and reported on its own, so one failure keeps the rest; none is
started after BUDGET_S seconds):
  timing_b1      ddpm-cifar10 (random weights), DDPM-1000 schedule, batch 1: ms/step of our eager fp16 loop,
                 of the engine running the eager model inside its graphs ("eng-eager"), and of the fused engine;
                 time to ready (first build in the process, then a second "warm" one), plan peak bytes,
                 per-layer choices ($OUT/layers_<model>_b<batch>.json);
  full_run_b1    one complete 1000-step DDPM run at batch 1: s/image;
  quality_fp16   engine fp16 vs our eager fp32 (TF32 off), DDIM 100 steps, same x_T, batch 8: PSNR;
  timing_b256    as timing_b1 at batch 256 (img/s);
  tests          the engine tests that need CUDA (graph replay == eager, streamed weights), the kernel features
                 the engine added (slices, conv upsample) and the CUDA tests of the three kernels it touched;
  steps_per_graph  capture seconds and ms/step at batch 1 for K = 10, 50, 200, 1000 (1000: the whole loop);
  quality_bf16, convnext_b1, convnext_b256   extras if time is left.
Writes $OUT/engine_check.json and $OUT/layers_<model>_b<batch>.json; prints a summary table last.
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
BUDGET_S = 330.0  # no section starts after this (compiles can make one take ~100 s; the limit is 8 min)
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


def make_model(preset: str = "ddpm-cifar10"):
    from fastdiff.models import PRESETS, model_from_config

    torch.manual_seed(0)
    return model_from_config(PRESETS[preset]).eval()


def draw(batch: int, shape: tuple[int, int, int], sampler):
    from fastdiff.samplers.noise import draw_noise

    return draw_noise(list(range(batch)), shape, sampler.num_steps if sampler.needs_noise else 0, "cuda")


def inputs(batch: int, steps: int, sampler):
    return draw(batch, (3, 32, 32), sampler)


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
    files = ["tests/engine/test_graph.py", "tests/engine/test_weights.py", "tests/engine/test_kernel_extensions.py",
             "tests/kernels/test_group_norm_act.py", "tests/kernels/test_conv2d.py",
             "tests/kernels/test_attention_gate.py"]  # fmt: skip
    selected = "cuda or graph_replay or extensions or group_norm or conv2d or attention_gate"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selected, *files]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": "src"})
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"returncode": proc.returncode, "tail": tail}


def quality(dtype: torch.dtype) -> dict:
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
    engine = Engine("cuda")
    engine.prepare(make_model(), sampler, 8, dtype)
    got = engine.run(x_t, None).clamp(-1, 1)
    values = psnr(got, ref)
    return {
        "psnr_db_mean": float(values.mean()),
        "psnr_db_min": float(values.min()),
        "max_abs_diff": float((got - ref).abs().max()),
        "finite": bool(torch.isfinite(got).all()),
        "ref_std": float(ref.std()),
    }


quality_fp16 = section("quality_fp16")(lambda: quality(torch.float16))
quality_bf16 = section("quality_bf16")(lambda: quality(torch.bfloat16))


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


def timing(preset: str, batch: int, steps: int, repeats: int) -> dict:
    from fastdiff.engine import Engine
    from fastdiff.samplers import ScheduleConfig, make_sampler

    sampler = make_sampler("ddpm", ScheduleConfig(), 1000, device="cuda")
    row: dict = {}
    sample = make_model(preset).config
    x_t, noise = draw(batch, (sample.in_channels, sample.sample_size, sample.sample_size), sampler)
    eager = make_model(preset).to("cuda", torch.float16).to(memory_format=torch.channels_last)
    row["eager_fp16_ms"] = time_loop_eager(eager, sampler, x_t, noise, 10 if batch > 1 else 30, 3)
    del eager
    for label, impl in (("engine_eagerunet", "eager"), ("engine", "fused")):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        engine = Engine("cuda", unet_impl=impl)
        model = make_model(preset)
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
            table = fused.layer_table()
            row["sum_of_op_us"] = sum(min(r["times_us"].values()) for r in table if r["times_us"])
            (OUT / f"layers_{preset}_b{batch}.json").write_text(json.dumps(table, indent=1) + "\n")
            chosen: dict = {}
            for r in table:
                chosen.setdefault(r["kind"], {}).setdefault(r["impl"], 0)
                chosen[r["kind"]][r["impl"]] += 1
            row["choices"] = chosen
            row["ops_tuned_from_cache"] = sum(r["why"].startswith("timed earlier") for r in table)
            # warm time to ready: a second engine in this process (kernels compiled, cuDNN/cuBLAS up)
            t0 = time.perf_counter()
            again = Engine("cuda")
            again.prepare(make_model(preset), sampler, batch, torch.float16)
            torch.cuda.synchronize()
            row["engine_ready_warm_s"] = time.perf_counter() - t0
            row["engine_ready_warm_timings"] = dict(again.timings)
            del again
        del engine
        torch.cuda.empty_cache()
    row["images_per_s_engine"] = batch / (row["engine_ms"] * 1e-3 * 1000)
    print(json.dumps(row, default=str)[:1500], flush=True)
    return row


timing_b1 = section("timing_b1")(lambda: timing("ddpm-cifar10", 1, 200, 5))
timing_b256 = section("timing_b256")(lambda: timing("ddpm-cifar10", 256, 20, 3))
convnext_b1 = section("convnext_b1")(lambda: timing("convnext-cifar10", 1, 200, 5))
convnext_b256 = section("convnext_b256")(lambda: timing("convnext-cifar10", 256, 20, 3))


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
    for name in ("quality_fp16", "quality_bf16"):
        if s.get(name):
            q = s[name]
            print(f"{name}: PSNR mean {q['psnr_db_mean']:.1f} dB, min {q['psnr_db_min']:.1f} dB (target >= 40)")
    cols = ("eager_fp16_ms", "engine_eagerunet_ms", "engine_ms", "images_per_s_engine", "engine_ready_s",
            "engine_ready_warm_s", "plan_peak_mb")  # fmt: skip
    heads = ("eager16", "eng-eager", "engine", "img/s", "ready_s", "warm_s", "planMB")
    print(f"{'run':>13} " + " ".join(f"{h:>9}" for h in heads))
    for key in ("timing_b1", "timing_b256", "convnext_b1", "convnext_b256"):
        if s.get(key):
            vals = [float(s[key].get(c, float("nan"))) for c in cols]
            print(f"{key:>13} " + " ".join(f"{v:9.3f}" for v in vals))
    print("(ms/step fp16; targets: ddpm b1 engine <= 0.5 ms/step, b256 >= 30 img/s, warm ready <= 5 s)")
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
    for run_section in (env, timing_b1, full_run, quality_fp16, timing_b256, tests, steps_per_graph, quality_bf16,
                        convnext_b1, convnext_b256):  # fmt: skip
        run_section()
    save()
    summary()
