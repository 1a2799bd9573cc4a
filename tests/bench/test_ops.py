"""The engine's per-op table: numbers against hand arithmetic, rows of a real fused model, the Markdown, failures
reported as unavailable, and (CUDA) the table of a bench run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_bench_runner import CONFIG, save_tiny_model

from fastdiff.bench import ops
from fastdiff.bench.ops import ENGINE_OP_CLASS, achieved, engine_op_table, op_table, step_op_rows
from fastdiff.bench.report import op_tables_markdown
from fastdiff.bench.runner import BenchConfig, measure_op_table, run_bench
from fastdiff.bench.systems import EngineSystem
from fastdiff.engine import FusedModel
from fastdiff.models.ddpm_unet import DDPMUNet
from fastdiff.samplers import ScheduleConfig, initial_noise, make_sampler, seed_tensor

CEILINGS = {"tflops": 100.0, "gbps": 1000.0, "matmul": "synthetic", "method": "given"}  # ridge: 100 FLOP/byte


def fake(name: str, kind: str, us: float, flops: float, nbytes: float) -> dict:
    return {"name": name, "kind": kind, "class": ENGINE_OP_CLASS[kind], "impl": "triton", "shape": [1, 1, 1, 1],
            "us": us, "flops": flops, "bytes": nbytes}  # fmt: skip


ROWS = [
    fake("big_conv", "conv", 100.0, 2e9, 1e7),  # 2e9 FLOP / 100 us = 20 TFLOP/s; 1e7 B / 100 us = 100 GB/s; I = 200
    fake("norm", "group_norm", 10.0, 5e6, 6e6),  # 6e6 B / 10 us = 600 GB/s; I = 0.83
    fake("small_conv", "conv", 20.0, 1e8, 1e7),  # 1e8 / 20 us = 5 TFLOP/s; 1e7 / 20 us = 500 GB/s; I = 10
    fake("sampler_step", "sampler_step", 4.0, 1e6, 2e6),  # 2e6 / 4 us = 500 GB/s
    fake("not_timed", "group_norm", 0.0, 1e6, 1e6),
]


def test_op_table_against_hand_numbers():
    table = op_table(ROWS, CEILINGS, kernels_per_step=7)
    assert table["ops_per_step"] == 5 and table["kernels_per_step"] == 7
    assert table["ops_ms_per_step"] == pytest.approx(0.134)
    ops = {o["name"]: o for o in table["ops"]}
    big = ops["big_conv"]  # compute-bound (200 > 100): 20 of 100 TFLOP/s
    assert big["tflops"] == pytest.approx(20) and big["gbps"] == pytest.approx(100)
    assert big["bound"] == "compute" and big["pct_of_ceiling"] == pytest.approx(20)
    assert big["pct_of_matmul"] == pytest.approx(20) and big["pct_of_copy"] == pytest.approx(10)
    small = ops["small_conv"]  # memory-bound (10 < 100): 500 of 1000 GB/s
    assert small["bound"] == "memory" and small["intensity"] == pytest.approx(10)
    assert small["pct_of_ceiling"] == pytest.approx(50) and small["pct_of_matmul"] == pytest.approx(5)
    norm = ops["norm"]
    assert norm["bound"] == "memory" and norm["gbps"] == pytest.approx(600) and norm["pct_of_copy"] == pytest.approx(60)
    assert ops["sampler_step"]["pct_of_ceiling"] == pytest.approx(50)
    assert all(ops["not_timed"][k] is None for k in ("tflops", "gbps", "bound", "pct_of_ceiling", "pct_of_copy"))

    classes = table["classes"]
    assert list(classes) == ["convolution", "normalisation", "sampler"]  # in order of first appearance
    conv = classes["convolution"]  # 2.1e9 FLOP and 2e7 B in 120 us
    assert conv["ops"] == 2 and conv["ms"] == pytest.approx(0.12)
    assert conv["tflops"] == pytest.approx(17.5) and conv["pct_of_matmul"] == pytest.approx(17.5)
    assert conv["gbps"] == pytest.approx(2e7 / 120e-6 / 1e9)
    assert conv["mean_pct_of_ceiling"] == pytest.approx(35)  # (20 + 50) / 2
    assert conv["pct_of_ops_ms"] == pytest.approx(100 * 120 / 134)
    norm_cls = classes["normalisation"]  # 7e6 B in 10 us (the untimed one adds no time); its mean skips it
    assert norm_cls["ops"] == 2 and norm_cls["gbps"] == pytest.approx(700)
    assert norm_cls["mean_pct_of_ceiling"] == pytest.approx(60)
    # the floor, each op at its bounding ceiling: 100 us at 20 % -> 20, 20 at 50 % -> 10, 10 at 60 % -> 6,
    # 4 at 50 % -> 2
    assert conv["floor_ms"] == pytest.approx(0.030) and norm_cls["floor_ms"] == pytest.approx(0.006)
    assert table["floor_ms_per_step"] == pytest.approx(0.038)
    with_fp8 = op_table([{**ROWS[0], "fp8": True}, *ROWS[1:]], CEILINGS)  # % of the bf16 ceiling: no floor
    assert with_fp8["floor_ms_per_step"] is None and with_fp8["classes"]["convolution"]["floor_ms"] is None
    assert achieved(ROWS[0]).keys() == {*ROWS[0], "tflops", "gbps"}  # no ceilings: no roofline fields


def test_step_op_rows_of_a_real_fused_model(monkeypatch):
    """Rows follow the step ops in order with their kinds, classes and engine_op_cost counts (times stubbed: the
    real ones need CUDA)."""
    fused = FusedModel(DDPMUNet(CONFIG).eval(), 1, torch.float32, "cpu")
    times = [float(i + 1) for i in range(len(fused.step_ops))]
    monkeypatch.setattr(fused, "time_ops", lambda reps=20: times)
    rows = step_op_rows(fused)
    assert [r["name"] for r in rows] == [op.name for op in fused.step_ops]
    assert [r["us"] for r in rows] == times
    assert {r["class"] for r in rows} == {"convolution", "normalisation", "attention"}
    conv_in = rows[0]  # 3 -> 6 channels, 3x3, 8x8, bias, fp32: 2 * 384 outputs * 27 + 384 bias adds = 21120 FLOPs;
    assert conv_in["kind"] == "conv" and conv_in["shape"] == [1, 6, 8, 8]  # input 192 + weights 162 + output 384
    assert conv_in["flops"] == 21120 and conv_in["bytes"] == 4 * (192 + 162 + 384 + 6)  # + bias 6, 4 bytes each
    table = op_table(rows, CEILINGS)
    assert table["ops_per_step"] == len(fused.step_ops)
    assert sum(c["ms"] for c in table["classes"].values()) == pytest.approx(table["ops_ms_per_step"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need the Triton interpreter (off with a GPU)")
def test_engine_op_table_glue_on_the_interpreter(monkeypatch):
    """The whole table of an engine system (Triton interpreter; the CUDA-graph timers and the profiler stubbed):
    every step op then the sampler step, no kernel count off CUDA, and the loop samples as before afterwards."""
    seeds = seed_tensor([0], "cpu")
    x_t = initial_noise(seeds, (3, 8, 8), "cpu")
    torch.manual_seed(0)
    model = DDPMUNet(CONFIG).eval()
    system = EngineSystem(lambda: model, torch.float32, torch.device("cpu"), x_t)
    system.prepare()
    sampler = make_sampler("ddpm", ScheduleConfig(), 1)  # one step: each forward takes a second in the interpreter
    before = system.run(x_t, seeds, sampler, 1)
    fused = system.engine.current_step_model
    monkeypatch.setattr(fused, "time_ops", lambda reps=20: [1.0] * len(fused.step_ops))
    monkeypatch.setattr(ops, "time_call_us", lambda call, reps: (call(), 2.0)[1])
    profiled = []

    def profile_breakdown(run_step, device, steps=3, warmup=2):  # the profiler is slow on the interpreter
        profiled.append((steps, warmup, system.engine.current.position))
        run_step()
        return {"kernels_seen": 0}  # what the real one sees off CUDA

    monkeypatch.setattr(ops, "profile_breakdown", profile_breakdown)
    table = engine_op_table(system, sampler, x_t, seeds, CEILINGS)
    assert table["ops_per_step"] == len(fused.step_ops) + 1 and table["kernels_per_step"] is None  # no CUDA kernels
    assert profiled == [(1, 0, 0)]  # one step, from step 0 (a full one), after the warm-up step
    assert [o["name"] for o in table["ops"][:-1]] == [op.name for op in fused.step_ops]
    last = table["ops"][-1]
    assert last["name"] == "sampler_step" and last["class"] == "sampler" and last["us"] == 2.0 and last["flops"] > 0
    assert "ddpm loop" in table["step"] and table["ops_ms_per_step"] == pytest.approx((len(fused.step_ops) + 2) / 1e3)
    assert torch.equal(system.run(x_t, seeds, sampler, 1), before)


def bench_result(op_tables: dict) -> dict:
    """A bench result with one engine row per ``op_tables`` entry, keyed by system or (system, dtype) (fp16)."""

    def row(system: str | tuple[str, str], extra: dict) -> dict:
        system, dtype = system if isinstance(system, tuple) else (system, "fp16")
        return {"system": system, "dtype": dtype, "ms_per_step": 0.2, "extra": extra}

    engines = [row(system, {"op_table": table}) for system, table in op_tables.items()]
    return {"ceilings": CEILINGS, "results": [row("eager", {}), *engines]}


def test_op_tables_markdown():
    table = {"step": "one full step", **op_table(ROWS, CEILINGS, kernels_per_step=7)}
    text = op_tables_markdown(bench_result({"engine": table, ("engine", "bf16"): {"unavailable": "boom"}}), top=3)
    assert "**engine-fp16** per op (one full step): 5 ops, 7 kernels per step" in text
    assert "0.134 ms of 0.200 ms/step" in text and "100 TFLOP/s (synthetic matmul), 1000 GB/s" in text
    assert "| convolution | 2 | 0.120 | 90% | 17.5 | 17.5 | 167 | 16.7 | 35.0 |" in text
    lines = text.splitlines()
    header = lines.index("| op | kind | impl | us | GFLOP | MB | TFLOP/s | GB/s | bound | % of ceiling |")
    top = [line.split(" | ")[0] for line in lines[header + 2 : header + 6]]
    assert top == ["| big_conv", "| small_conv", "| norm", ""]  # the 3 slowest, slowest first, then the next part
    assert "| big_conv | conv | triton | 100.0 | 2 | 10 | 20 | 100 | compute | 20.0 |" in text
    assert "**engine-bf16** per-op table unavailable: boom." in text
    assert op_tables_markdown(bench_result({})) == ""


def test_op_table_unavailable_without_failing_the_row():
    def broken_loop(sampler, batch):
        raise RuntimeError("graph capture failed\nsecond line")

    system = SimpleNamespace(name="engine", loop=broken_loop)
    x = torch.zeros(1, 3, 8, 8)
    assert measure_op_table(system, None, x, None, CEILINGS) == {"unavailable": "RuntimeError: graph capture failed"}
    eager = SimpleNamespace(loop=lambda sampler, batch: None, engine=SimpleNamespace(current_step_model=object()))
    assert "no fused ops" in engine_op_table(eager, None, x, None, CEILINGS)["unavailable"]


def test_cpu_bench_has_no_op_table(tmp_path):
    save_tiny_model(tmp_path)
    cfg = BenchConfig(model=str(tmp_path), batch=1, steps=2, timed_steps=2, repeats=1, quality_steps=2,
                      systems=("eager-fp32", "engine-fp16"), device="cpu")  # fmt: skip
    result = run_bench(cfg)
    assert result["config"]["op_table"] is True and result["ceilings"] is None  # engine skipped: nothing measured
    assert not any("op_table" in r["extra"] for r in result["results"])
    assert op_tables_markdown(result) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bench_op_table(tmp_path):
    save_tiny_model(tmp_path)
    cfg = BenchConfig(model=str(tmp_path), batch=2, steps=4, timed_steps=4, repeats=1, quality_steps=2,
                      energy_seconds=0.1, systems=("engine-fp16", "engine-bf16"), device="cuda")  # fmt: skip
    result = run_bench(cfg)
    ceil = result["ceilings"]
    assert ceil["tflops"] > 0 and ceil["gbps"] > 0
    for row in result["results"]:
        assert row["error"] is None, row["error"]
        table = row["extra"]["op_table"]
        assert "unavailable" not in table, table
        assert table["ops"][-1]["name"] == "sampler_step"
        launched = [o for o in table["ops"] if o["impl"] != "fused"]  # fused: a shortcut summed in its conv2
        assert all(o["us"] > 0 and o["flops"] > 0 and o["pct_of_ceiling"] > 0 for o in launched)
        assert all(o["us"] == 0 and o["flops"] == 0 for o in table["ops"] if o not in launched)
        assert table["kernels_per_step"] >= len(launched)  # every launching op launches at least one kernel
        assert f"**{row['system']}-fp16** per op" in op_tables_markdown(result)
    off = run_bench(dataclasses.replace(cfg, op_table=False, systems=("engine-fp16",)))
    assert off["ceilings"] is None and "op_table" not in off["results"][0]["extra"]
