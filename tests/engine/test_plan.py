"""Memory planner: live buffers never overlap, bounds on the peak, concat slices alias their buffer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastdiff.engine.executor import FusedModel
from fastdiff.engine.plan import ALIGNMENT, BufferSpec, MemoryPlan, max_live_bytes, plan_memory
from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import DDPM_PRESETS, DDPMUNet


def assert_no_live_overlap(plan: MemoryPlan) -> None:
    specs = list(plan.specs.values())
    for i, a in enumerate(specs):
        for b in specs[i + 1 :]:
            if a.first <= b.last and b.first <= a.last and a.nbytes and b.nbytes:
                a0, b0 = plan.offsets[a.name], plan.offsets[b.name]
                assert a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0, (a, b, a0, b0)


@pytest.mark.parametrize("seed", range(25))
def test_random_lifetimes_never_overlap(seed):
    rng = random.Random(seed)
    specs = []
    for k in range(rng.randint(1, 60)):
        first = rng.randint(0, 80)
        specs.append(BufferSpec(f"b{k}", rng.choice([1, 7, 300, 4096, rng.randint(1, 50_000)]), first,
                                first + rng.choice([0, 1, 3, rng.randint(0, 40)])))  # fmt: skip
    plan = plan_memory(specs)
    assert_no_live_overlap(plan)
    assert all(off % ALIGNMENT == 0 for off in plan.offsets.values())
    assert max_live_bytes(specs) <= plan.peak_bytes <= plan.total_bytes


def test_disjoint_lifetimes_share_memory():
    plan = plan_memory([BufferSpec("a", 1000, 0, 1), BufferSpec("b", 1000, 2, 3), BufferSpec("c", 500, 1, 2)])
    assert plan.offsets["a"] == plan.offsets["b"]
    assert plan.peak_bytes == 1024 + 512  # c (aligned to 512) sits after a/b


def test_bad_specs_raise():
    with pytest.raises(FastdiffError, match="planned twice"):
        plan_memory([BufferSpec("a", 1, 0, 0), BufferSpec("a", 1, 0, 0)])
    with pytest.raises(FastdiffError, match="lifetime"):
        plan_memory([BufferSpec("a", 1, 3, 2)])


def byte_range(fused: FusedModel, v) -> tuple[int, int] | None:
    """[start, end) of ``v``'s root buffer in the arena; None outside it (input, persistent)."""
    root = v.concat if v.concat is not None else v
    offset = fused.plan.offsets.get(root.name)
    return None if offset is None else (offset, offset + math.prod(root.shape) * fused.dtype.itemsize)


def assert_apart(fused: FusedModel, a, b, why: str) -> None:
    ra, rb = byte_range(fused, a), byte_range(fused, b)
    assert ra is None or rb is None or ra[1] <= rb[0] or rb[1] <= ra[0], f"{why}: {a.name} {ra} and {b.name} {rb}"


def check_fused_plan(fused: FusedModel) -> None:
    assert_no_live_overlap(fused.plan)
    for name, sc in fused.pairs["sc"].items():  # conv2 with its shortcut summed in reads the shortcut's input
        assert_apart(fused, sc.inputs[0], fused.op_by_name[name].output, f"{name} fused with {sc.name}")
    for name, norm in fused.pairs["gn"].items():  # a conv with a norm in its epilogue writes the norm's output
        conv = fused.op_by_name[name]
        sc = fused.pairs["sc"].get(name)  # with its shortcut summed in, the conv also reads the shortcut's input
        for value in (*conv.inputs, conv.output, *((sc.inputs[0],) if sc is not None else ())):
            if value is not norm.output:
                assert_apart(fused, value, norm.output, f"{name} with {norm.name} in its epilogue")
    specs = list(fused.plan.specs.values())
    assert max_live_bytes(specs) <= fused.plan.peak_bytes <= fused.plan.total_bytes
    fused._x_in = torch.empty(0)  # only needed for the external input, never looked up here
    slices = [v for v in fused.values if v.concat is not None]
    assert slices, "the up path should write into concat slices"
    item = fused.dtype.itemsize
    for v in slices:
        t, parent = fused.tensor(v), fused.tensor(v.concat)
        assert t.data_ptr() == parent.data_ptr() + v.channel_offset * item
        assert t.stride() == parent.stride() and tuple(t.shape) == v.shape
        # in the arena, but for the concat holding the step cache's deep feature: its own persistent buffer
        home = fused.persistent[v.concat.name] if v.concat is fused.cached_value.concat else fused.arena
        assert t.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
    for v in fused.values:  # every planned tensor lies inside the arena
        if v.concat is None and v.name in fused.plan.offsets:
            t = fused.tensor(v)
            end = t.data_ptr() + t.numel() * item
            assert fused.arena.data_ptr() <= t.data_ptr() and end <= fused.arena.data_ptr() + fused.arena.numel()


def test_tiny_unet_plan(tiny_name, tiny_model):
    check_fused_plan(FusedModel(tiny_model(tiny_name, 0), 3, torch.float32, "cpu", "triton", "triton"))


def test_pow2_unet_plan_with_epilogue_norms(tiny_model):
    fused = FusedModel(tiny_model("pow2", 0), 2, torch.float32, "cpu", "triton", "triton")
    assert fused.pairs["gn"]
    check_fused_plan(fused)


def test_cifar10_plan_reuses_memory():
    model = DDPMUNet(DDPM_PRESETS["ddpm-cifar10"]).eval()
    fused = FusedModel(model, 2, torch.float16, "cpu", "triton", "triton")
    check_fused_plan(fused)
    assert fused.plan.peak_bytes < 0.5 * fused.plan.total_bytes
    aliased = [r for r in fused.layer_table() if r["output"].startswith("slice")]
    assert len(aliased) == 24  # both parts of all 12 concats: skips and up-path inputs are written in place
    assert not any(op.kind == "copy" for op in fused.ops)
