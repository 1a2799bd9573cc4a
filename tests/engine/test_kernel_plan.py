"""Kernel plans (``fastdiff.engine.kernel_plan``): the JSON round trip, one-line refusals of bad files, a plan's
choice taken by the engine (only its kernels run), a foreign or stale plan refused with a log line and a fallback,
and the same plan giving the same choice and the same bytes in two processes (the interpreter's engine)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastdiff.engine import Engine
from fastdiff.engine.kernel_plan import KernelPlan, PlanEntry, find_entries, structure_digest
from fastdiff.errors import FastdiffError
from fastdiff.samplers import ScheduleConfig, make_sampler, seed_tensor

from .conftest import DEVICE, make_tiny, rel_err

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU (interpreter) half; the GPU half is benchmarks")


def _engine_run(engine: Engine, model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    sampler = make_sampler("ddim", ScheduleConfig(timestep_spacing="trailing"), 2, device=DEVICE)
    x_t = torch.randn(
        (batch, model.config.in_channels, *model.config.sample_size), generator=torch.Generator().manual_seed(5)
    )
    return engine.sample(model, sampler, x_t, seed_tensor(list(range(batch)), DEVICE), torch.float32)


def test_plan_json_round_trip_and_digest(tmp_path):
    plan = KernelPlan("NVIDIA H100 80GB HBM3")
    plan.add("abc", PlanEntry({"conv_in": "triton-k2", "mid.attn": "sdpa"}, "a label", {"how": "tuned"}))
    path = plan.save(tmp_path / "plan.json")
    back = KernelPlan.load(path)
    assert back.gpu == plan.gpu and back.entries["abc"].choices == plan.entries["abc"].choices
    assert back.entries["abc"].digest() == plan.entries["abc"].digest()
    assert PlanEntry({"conv_in": "cudnn", "mid.attn": "sdpa"}).digest() != plan.entries["abc"].digest()
    assert back.lookup("NVIDIA H200", "abc") is None  # another GPU model's plan is not used
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "cannot be read"),
        ('{"format": "something else"}', "is not a fastdiff kernel plan"),
        ('{"format": "fastdiff-kernel-plan", "version": 99, "gpu": "x", "entries": {}}', "version 99"),
        ('{"format": "fastdiff-kernel-plan", "version": 1, "entries": {}}', 'needs a "gpu"'),
        ('{"format": "fastdiff-kernel-plan", "version": 1, "gpu": "x", "entries": {"k": {"choices": [1]}}}', "choices"),
    ],
)
def test_bad_plan_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(FastdiffError, match=message) as info:
        KernelPlan.load(path)
    assert "\n" not in str(info.value)
    with pytest.raises(FastdiffError, match="does not exist"):
        Engine(DEVICE, plan=tmp_path / "missing.json")


@pytest.mark.slow
def test_structure_digest_follows_shapes_and_dtype():
    small, other = make_tiny("center_scaled", 1), make_tiny("attn_pad0", 1)
    engine = Engine(DEVICE)
    a = engine.step_model(small, 2, torch.float32)
    b = engine.step_model(small, 3, torch.float32)
    c = engine.step_model(other, 2, torch.float32)
    assert len({a.structure(), b.structure(), c.structure()}) == 3
    assert a.structure() == structure_digest(a.ops, str(torch.float32), _extra(a))
    assert a.structure() != structure_digest(a.ops, str(torch.float16), _extra(a))


def _extra(fused) -> dict:
    pairs = sorted((tag, conv, p.name) for tag, pairs in fused.pairs.items() for conv, p in pairs.items())
    return {"pairs": pairs, "conv_impl": fused.conv_impl, "attention_impl": fused.attention_impl}


def test_engine_takes_a_given_plan(tmp_path, monkeypatch):
    """A plan that sends every conv to the vendor path ("cudnn": torch's conv on the CPU) is what runs; the output
    still equals the default choice's; the engine's used plan and digest say so; nothing is cached on the CPU."""
    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny("center_scaled", 3)
    default_engine = Engine(DEVICE)
    ref = _engine_run(default_engine, model)
    fused = default_engine.current_step_model
    ((structure, entry),) = default_engine.used_plan.entries.items()
    assert set(entry.choices) == {op.name for op in fused.ops}
    assert default_engine.plan_sources[structure] == "default"
    convs = [op.name for op in fused.ops if op.kind == "conv"]
    assert convs and all(entry.choices[c] == "triton" for c in convs)

    choices = {**entry.choices, **dict.fromkeys(convs, "cudnn")}
    plan = KernelPlan("cpu", {structure: PlanEntry(choices, "by hand")})
    plan_file = plan.save(tmp_path / "plan.json")
    engine = Engine(DEVICE, plan=plan_file)
    out = _engine_run(engine, model)
    assert rel_err(out, ref) < 1e-5
    assert {c: engine.current_step_model.impls[c].name for c in convs} == dict.fromkeys(convs, "cudnn")
    assert engine.plan_sources[structure] == "given"
    assert engine.plan_digest == PlanEntry(choices).digest() != default_engine.plan_digest
    saved = engine.save_plan(tmp_path / "used.json")
    assert KernelPlan.load(saved).entries[structure].choices == choices
    assert not (tmp_path / "cache").exists()  # the CPU never tunes, so it writes no plan


def test_a_plan_packs_only_the_layouts_its_kernels_read(tmp_path, monkeypatch, caplog):
    """With a plan, the first forward packs and uploads each op's layouts for its planned kernel (and for the kernel
    it runs in the first forward) only: the vendor convs get the library layout alone, ours the packed one alone;
    a conv2 that sums its shortcut in (a CUDA candidate, offered here on the CPU too) reads the shortcut's packed
    weights, which the shortcut (fused; its own default kernel in the first forward) keeps. The output equals the
    default engine's."""
    import fastdiff.engine.executor as executor
    from fastdiff.engine.impl import Impl

    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny("attn_pad0", 4)
    default_engine = Engine(DEVICE)
    ref = _engine_run(default_engine, model)
    fused = default_engine.current_step_model
    assert all({"packed", "weight"} <= set(fused.device_weights[op.name]) for op in fused.ops if op.kind == "conv")
    ((structure, entry),) = default_engine.used_plan.entries.items()
    pairs = {name: sc.name for name, sc in fused.pairs["sc"].items()}
    assert pairs
    plain = [op.name for op in fused.ops if op.kind == "conv" and op.name not in {*pairs, *pairs.values()}]
    vendor = plain[::2]
    choices = {**entry.choices, **dict.fromkeys(vendor, "cudnn"), **dict.fromkeys(pairs, "triton-sc")}
    choices.update(dict.fromkeys(pairs.values(), "fused"))
    offered = executor.candidates

    def with_shortcut_sums(model, op):
        own = offered(model, op)
        return (*own, Impl.parse("triton-sc")) if op.name in pairs and model is not fused else own

    packed: dict[str, set[str]] = {}  # what the first forward packed, before the unused layouts are dropped
    pack = executor.packed_weights

    def recording(op, *args):
        out = pack(op, *args)
        packed[op.name] = set(out) - {"bias"}
        return out

    monkeypatch.setattr(executor, "candidates", with_shortcut_sums)
    monkeypatch.setattr(executor, "packed_weights", recording)
    engine = Engine(DEVICE, plan=KernelPlan("cpu", {structure: PlanEntry(choices)}).save(tmp_path / "plan.json"))
    out = _engine_run(engine, model)
    assert rel_err(out, ref) < 1e-5
    planned = engine.current_step_model
    assert engine.plan_sources[structure] == "given"
    assert {name: planned.impls[name].name for name in pairs} == dict.fromkeys(pairs, "triton-sc")
    for op in planned.ops:
        if op.name in vendor:
            assert packed[op.name] == {"weight"}, op.name
        elif op.kind == "conv":
            assert packed[op.name] == {"packed"}, op.name

    # a shortcut planned into a conv2's launch that the plan does not fuse: refused, the engine falls back
    choices.update(dict.fromkeys(pairs, "triton"))
    engine = Engine(DEVICE, plan=KernelPlan("cpu", {structure: PlanEntry(choices)}).save(tmp_path / "bad.json"))
    with caplog.at_level(logging.WARNING, logger="fastdiff.engine"):
        assert rel_err(_engine_run(engine, model), ref) < 1e-5
    assert engine.plan_sources[structure] == "default"
    lines = [r.getMessage() for r in caplog.records]
    assert any("cannot be used (it runs" in line and "in the launch of" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"first": "triton-warp9"}, "unknown implementation"),
        ({"first": "sdpa"}, "is not an implementation of op"),
        ({"drop": True}, "has no implementation for op"),
    ],
)
def test_a_plan_that_cannot_be_used_is_refused_with_one_line(tmp_path, caplog, change, why):
    model = make_tiny("center_scaled", 4)
    engine = Engine(DEVICE)
    ref = _engine_run(engine, model)
    ((structure, entry),) = engine.used_plan.entries.items()
    choices = dict(entry.choices)
    first = next(name for name in choices if name.endswith("conv_in") or "conv" in name)
    if change.get("drop"):
        del choices[first]
    else:
        choices[first] = change["first"]
    bad = KernelPlan("cpu", {structure: PlanEntry(choices)})
    with caplog.at_level(logging.WARNING, logger="fastdiff.engine"):
        fallback = Engine(DEVICE, plan=bad)
        out = _engine_run(fallback, model)
    assert torch.equal(out, ref)
    lines = [r.getMessage() for r in caplog.records if "kernel plan" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and "\n" not in lines[0]
    assert fallback.plan_sources[structure] == "default"


def test_entries_are_tried_given_then_shipped_then_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(tmp_path))
    cache = KernelPlan("gpu-x", {"s": PlanEntry({"a": "cudnn"})})
    cache.save(tmp_path / "plans" / "gpu-x.json")
    assert [source for _, source in find_entries("gpu-x", "s")] == ["cache"]
    given = KernelPlan("gpu-x", {"s": PlanEntry({"a": "triton"})})
    found = find_entries("gpu-x", "s", given)
    assert [source for _, source in found] == ["given", "cache"] and found[0][0].choices == {"a": "triton"}
    assert find_entries("gpu-y", "s", given) == []


@pytest.mark.slow
def test_a_refused_entry_falls_through_to_the_next(tmp_path, monkeypatch, caplog):
    """A given plan that cannot be used here gives way to the cache's, which the engine then runs."""
    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(tmp_path))
    model = make_tiny("center_scaled", 6)
    engine = Engine(DEVICE)
    _engine_run(engine, model)
    ((structure, entry),) = engine.used_plan.entries.items()
    convs = [op.name for op in engine.current_step_model.ops if op.kind == "conv"]
    good = {**entry.choices, convs[0]: "cudnn"}
    KernelPlan("cpu", {structure: PlanEntry(good)}).save(tmp_path / "plans" / "cpu.json")
    bad = KernelPlan("cpu", {structure: PlanEntry({**entry.choices, convs[0]: "sdpa"})})
    with caplog.at_level(logging.WARNING, logger="fastdiff.engine"):
        second = Engine(DEVICE, plan=bad)
        _engine_run(second, model)
    assert second.plan_sources[structure] == "cache"
    assert second.current_step_model.impls[convs[0]].name == "cudnn"
    assert any("trying the next" in r.getMessage() for r in caplog.records)


SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    sys.path.insert(0, sys.argv[2])
    from conftest import make_tiny
    from fastdiff.engine import Engine
    from fastdiff.samplers import ScheduleConfig, make_sampler, seed_tensor
    model = make_tiny("attn_pad0", 9)
    engine = Engine("cpu", plan=sys.argv[1])
    sampler = make_sampler("ddim", ScheduleConfig(timestep_spacing="trailing"), 2, device="cpu")
    x_t = torch.randn((2, 3, 6, 10), generator=torch.Generator().manual_seed(1))
    out = engine.sample(model, sampler, x_t, seed_tensor([0, 1], "cpu"), torch.float32)
    impls = {k: v.name for k, v in engine.current_step_model.impls.items()}
    print(json.dumps({"impls": impls, "sha": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
                      "digest": engine.plan_digest}))
    """
)


@pytest.mark.slow
def test_same_plan_same_choice_and_bytes_in_two_processes(tmp_path):
    model = make_tiny("attn_pad0", 9)
    engine = Engine(DEVICE)
    _engine_run(engine, model)
    ((structure, entry),) = engine.used_plan.entries.items()
    convs = [op.name for op in engine.current_step_model.ops if op.kind == "conv"]
    choices = {**entry.choices, **{c: "cudnn" for c in convs[::2]}}  # a mixed choice, not every op's default
    plan_file = KernelPlan("cpu", {structure: PlanEntry(choices)}).save(tmp_path / "plan.json")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FASTDIFF_CACHE_DIR": str(tmp_path / "cache")}
    here = str(Path(__file__).resolve().parent)
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", SCRIPT, str(plan_file), here],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0]["impls"] == choices and runs[0]["digest"] == PlanEntry(choices).digest()
