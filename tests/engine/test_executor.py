"""Fused DDPMUNet forward vs the eager model (fp32; Triton interpreter on the CPU), arena poisoned with NaN."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from fastdiff.engine import tuning
from fastdiff.engine.candidates import candidates
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.impl import APPLY, FUSED, Impl
from fastdiff.engine.kernel_plan import PlanEntry
from fastdiff.engine.weights import SyncBackend, WeightStreamer
from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d_tma import tma_conv_unsupported
from fastdiff.models.convnext_unet import ConvNeXtUNet, ConvNeXtUNetConfig
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

from .conftest import DEVICE, TOL, rel_err


def assert_two_forwards_match_eager(fused: FusedModel, model, seed: int) -> None:
    """Two forwards in a row (t = 999, then 3; the second without the streamed-weight waits) against the float64
    eager model on the CPU; the output finite and channels-last."""
    gen = torch.Generator().manual_seed(seed)
    shape = fused.x_in_value.shape
    for t in (999, 3):
        x = torch.randn(shape, generator=gen)
        x_in = channels_last_empty(shape, torch.float32, DEVICE).copy_(x.to(DEVICE))
        out = fused.forward(x_in, torch.tensor([t], device=DEVICE))
        with torch.no_grad():
            ref = model.double().cpu()(x.double(), torch.tensor([t]))
            model.to(DEVICE, torch.float32)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("impls", [("triton", "triton"), ("cudnn", "sdpa")])
def test_fused_matches_eager(tiny_name, tiny_model, impls):
    model = tiny_model(tiny_name, seed=zlib.crc32(f"{tiny_name}{impls}".encode()) % 1000).to(DEVICE)
    batch = 3
    fused = FusedModel(model, batch, torch.float32, DEVICE, *impls)
    fused.arena.view(torch.float32).fill_(float("nan"))
    assert_two_forwards_match_eager(fused, model, seed=7)


@pytest.mark.slow
def test_split_k_convs_match_eager(tiny_model):
    """Every conv on the split-K gather kernel (``triton-k3``, the implementation autotune may pick where a conv's
    grid leaves SMs idle) and every attention split over its keys (``triton-kv2``), sharing one workspace, two
    forwards in a row: equal to the eager model."""
    model = tiny_model("attn_pad0", 9).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "triton", "triton")
    for op in fused.ops:
        if op.kind == "conv":
            fused.impls[op.name] = Impl("triton", split_k=3)
        elif op.kind == "attention":  # the keys split too (60 tokens: 30 per split)
            fused.impls[op.name] = Impl("triton", split_kv=2)
    assert_two_forwards_match_eager(fused, model, seed=8)
    assert fused.split_workspace.counters is not None and not fused.split_workspace.counters.any()


@pytest.mark.parametrize("split", ["", "-k3"], ids=["one_program_per_tile", "split_k3"])
def test_shortcut_summed_in_conv2_matches_eager(tiny_model, split):
    """Every ResnetBlock2D conv2 that adds a 1x1 conv_shortcut runs with the shortcut summed in (``triton-sc``):
    the shortcut launches nothing, the bias pair is summed, and the forward equals the eager model."""
    model = tiny_model("attn_pad0", 4).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "triton", "triton")
    shortcuts = [op.name for op in fused.ops if op.name.endswith("conv_shortcut")]
    assert shortcuts and sorted(sc.name for sc in fused.pairs["sc"].values()) == sorted(shortcuts)
    for name in fused.pairs["sc"]:
        fused.impls[name] = Impl.parse(f"triton-sc{split}")
    assert_two_forwards_match_eager(fused, model, seed=12)
    assert all(fused.impls[sc.name] == FUSED for sc in fused.pairs["sc"].values())


class DeferredCopies(SyncBackend):
    """A copy stream that has not got there yet: each upload lands only when its module's event is waited for, and
    until then the device tensor holds NaN (memory the process used before)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.fill_(float("nan"))
        self.pending.append((dst, src.clone()))

    def pack(self, pack, sources: dict[str, torch.Tensor], resident: bool) -> dict[str, torch.Tensor]:
        """Packing runs on the copy stream behind the copies: its layouts are NaN until the event is waited for."""
        by_upload = {id(dst): src for dst, src in self.pending}
        real = pack({role: by_upload.get(id(t), t) for role, t in sources.items()})
        out = {role: torch.full_like(t, float("nan")) for role, t in real.items()}
        self.pending = [(d, s) for d, s in self.pending if id(d) not in {id(t) for t in sources.values()}]
        self.pending += [(out[role], real[role]) for role in real]
        return out

    def record(self) -> list:
        event, self.pending = self.pending, []
        return event

    def wait(self, event: list) -> None:
        for dst, src in event:
            dst.copy_(src)


@pytest.mark.parametrize("via_plan", [False, True], ids=["set", "plan"])
def test_shortcut_pair_bias_waits_for_both_uploads(tiny_model, via_plan, monkeypatch):
    """The fused pair's bias (conv2's + the shortcut's) is summed when the call is built, which with a plan is
    before the forward waits for the uploads: the sum must wait for both, or it reads what the copy stream has not
    written (an all-NaN SD 1.5 image on the H100, docs/engine/nan-with-gpu-drawn-weights.md)."""
    model = tiny_model("attn_pad0", 4).to(DEVICE)
    backend = DeferredCopies()
    fused = FusedModel(model, 2, torch.float32, DEVICE, "triton", "triton", WeightStreamer(DEVICE, backend))
    x = torch.randn(fused.x_in_value.shape, generator=torch.Generator().manual_seed(5))
    x_in = channels_last_empty(x.shape, torch.float32, DEVICE).copy_(x)
    # the candidates' fit checks read the bound input's layout (on CUDA): a plan naming nothing binds it and is refused
    assert fused.apply_plan(PlanEntry({}), x_in) is not None
    choices = {op.name: candidates(fused, op)[0].name for op in fused.ops}
    for name, shortcut in fused.pairs["sc"].items():
        choices[name], choices[shortcut.name] = "triton-sc", FUSED.name
    if via_plan:  # (-sc is a CUDA candidate: offered here on the CPU too)
        import fastdiff.engine.executor as executor

        offered = executor.candidates
        sc = Impl.parse("triton-sc")
        monkeypatch.setattr(
            executor, "candidates", lambda m, op: (*offered(m, op), *([sc] * (op.name in fused.pairs["sc"])))
        )
        assert fused.apply_plan(PlanEntry(choices), x_in) is None
    else:
        fused.impls.update({name: Impl.parse(c) for name, c in choices.items()})
    out = fused.forward(x_in, torch.tensor([999]))
    with torch.no_grad():
        ref = model.double()(x.double().to(DEVICE), torch.tensor([999], device=DEVICE))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL
    pair_biases = fused.fusion_state["sc"].values()
    assert pair_biases and all(torch.isfinite(b).all() for b in pair_biases)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon conv runs on the GPU only")
@pytest.mark.parametrize("impl", ["gluon-sc", "gluon-p2-sc"])
def test_shortcut_summed_in_the_gluon_conv_matches_unfused(impl):
    """The same pairs on the Gluon conv (fp16, a U-Net of 64 and 128 channels, every pair forced): the shortcut's
    input a concat part on the up path, the bias pair summed; equal to the fp16 engine with every pair unfused."""
    torch.manual_seed(6)
    config = DDPMUNetConfig(
        sample_size=(8, 8), in_channels=3, out_channels=3, block_out_channels=(64, 128), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1, attention_head_dim=None,
    )  # fmt: skip
    model = DDPMUNet(config).eval().to(DEVICE)
    fused = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton")
    assert any(name.startswith("up_blocks") for name in fused.pairs["sc"])
    offered = [
        name
        for name in fused.pairs["sc"]
        if {"gluon-sc", "gluon-p2-sc"} <= {impl.name for impl in candidates(fused, fused.op_by_name[name])}
    ]
    assert offered, "the autotune offers the Gluon forms where the conv is in the Gluon conv's domain"
    x = channels_last_empty(fused.x_in_value.shape, torch.float16, DEVICE).normal_(generator=torch.Generator(DEVICE))
    t = torch.tensor([500], device=DEVICE)
    plain = fused.forward(x, t).clone()
    for name in fused.pairs["sc"]:
        fused.impls[name] = Impl.parse(impl)
    fused.bind(x)
    assert rel_err(fused.forward(x, t), plain) < 5e-3
    assert all(fused.impls[sc.name] == FUSED for sc in fused.pairs["sc"].values())


@pytest.mark.slow
def test_split_k_tma_convs_match_eager(tiny_model):
    """Every conv the TMA kernel can run (stride 1, TMA-aligned: the 8- and 16-channel convs of the pow2 U-Net, on
    CUDA its Upsample2D too) on it split three ways (``triton-tma-k3``: the engine path of the fp8 convs' split-K,
    which the autotune offers only to those; forced here, also in the interpreter), sharing the engine's one
    workspace: two forwards equal to the eager model, and every split counter back at 0."""
    model = tiny_model("pow2", 8).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "triton", "triton")
    forced = 0
    for op in fused.ops:
        p = op.params
        if op.kind != "conv" or p["stride"] != 1 or "pad_end" in p or op.inputs[0] is fused.x_in_value:
            continue  # (the 3-channel graph input is not TMA-aligned anyway)
        if p["upsample"] == 2 and DEVICE.type != "cuda":  # the engine packs the phase weights on CUDA only
            continue
        x = fused.tensor(op.inputs[0])
        if tma_conv_unsupported(x, op.output.shape[1], p["ksize"], padding=p["padding"], upsample=p["upsample"]):
            continue
        fused.impls[op.name], forced = Impl("triton-tma", split_k=3), forced + 1
    upsampled = [op for op in fused.ops if fused.impls.get(op.name) == Impl("triton-tma", split_k=3)
                 and op.params["upsample"] == 2]  # fmt: skip
    assert forced >= 8 and (len(upsampled) == 1 or DEVICE.type != "cuda")
    assert_two_forwards_match_eager(fused, model, seed=14)
    assert not fused.split_workspace.counters.any()


def force_pair_impl(fused: FusedModel, convs, impl: str) -> None:
    """Every conv of ``convs`` on ``impl`` (a ``triton-<tag>[-k<N>]`` gather variant), as ``triton-sc-<tag>...``
    where the conv also sums its shortcut in."""
    for name in convs:
        fused.impls[name] = Impl.parse(impl).with_fusion("sc") if name in fused.pairs["sc"] else Impl.parse(impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton-gn", "triton-gn-k3"])
def test_group_norm_in_conv_epilogue_matches_eager(tiny_model, impl):
    """Every conv whose output a GroupNorm reads (8x8 and 4x4 images) with that norm in its epilogue, split-K or not,
    the shortcut-adding conv2 too (``triton-sc-gn``): the norms launch nothing, and two forwards in a row equal the
    eager model (the arena poisoned with NaN: a norm output left unwritten would show)."""
    model = tiny_model("pow2", 5).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "triton", "triton")
    norms = [op for op in fused.ops if op.kind == "group_norm"]
    assert len(fused.pairs["gn"]) >= len(norms) // 2  # the up path's concat norms stay
    force_pair_impl(fused, fused.pairs["gn"], impl)
    shape = fused.x_in_value.shape  # the streamed first forward runs the norms on their own: get it out of the way
    fused.forward(channels_last_empty(shape, torch.float32, DEVICE).normal_(), torch.tensor([5], device=DEVICE))
    fused.arena.view(torch.float32).fill_(float("nan"))
    assert_two_forwards_match_eager(fused, model, seed=13)
    assert all(fused.impls[norm.name] == FUSED for norm in fused.pairs["gn"].values())
    launched = sum(fused.impls[op.name].launches for op in fused.step_ops)
    summed = sum(fused.impls[sc.name] == FUSED for sc in fused.pairs["sc"].values())
    assert launched == len(fused.step_ops) - len(fused.pairs["gn"]) - summed


@pytest.mark.slow
@pytest.mark.parametrize(("name", "impl"), [("attn_pad0", "triton-st"), ("pow2", "triton-st-k3")])
def test_group_norm_statistics_in_conv_epilogue_match_eager(tiny_model, name, impl):
    """Every conv whose output a GroupNorm reads writes that norm's partial statistics (``-st``; groups of 3
    channels, images of 6x10 that straddle row tiles; split-K or not, the shortcut-adding conv2 too), and the norm
    runs as one pass that merges them (``apply``): two forwards in a row equal the eager model, the arena poisoned
    with NaN."""
    model = tiny_model(name, 6).to(DEVICE)
    fused = FusedModel(model, 3, torch.float32, DEVICE, "triton", "triton")
    norms = [op for op in fused.ops if op.kind == "group_norm"]
    assert len(fused.pairs["st"]) >= len(norms) // 2  # the up path's concat norms stay
    force_pair_impl(fused, fused.pairs["st"], impl)
    fused.arena.view(torch.float32).fill_(float("nan"))
    assert_two_forwards_match_eager(fused, model, seed=14)
    assert all(fused.impls[norm.name] == APPLY for norm in fused.pairs["st"].values())
    assert sorted(fused.fusion_state["st"]) == sorted(norm.name for norm in fused.pairs["st"].values())


@pytest.mark.slow
def test_epilogue_norms_in_the_shallow_forward(tiny_model):
    """With the step cache's shallow forward (only the ops its output needs, on the kept deep feature), every pair
    runs in both forwards or in neither: the shallow forward with all norms in their convs' epilogues equals the
    same forward with every op on its own (a norm left to a conv the shallow forward skips would read stale data)."""
    model = tiny_model("pow2", 8).to(DEVICE)
    fused, plain = (FusedModel(model, 1, torch.float32, DEVICE, "triton", "triton") for _ in range(2))
    assert fused.cached_value is not None and fused.pairs["gn"]
    shallow = {op.name for op in fused.shallow_ops}
    assert any(name in shallow for name in fused.pairs["gn"])  # some pairs run in the shallow forward too
    force_pair_impl(fused, fused.pairs["gn"], "triton-gn")
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(fused.x_in_value.shape, generator=gen) for _ in range(3)]
    outs = {}
    for key, model_ in (("fused", fused), ("plain", plain)):
        runs = []
        for x, t, shallow_step in zip(xs, (999, 500, 3), (False, False, True), strict=True):
            x_in = channels_last_empty(x.shape, torch.float32, DEVICE).copy_(x.to(DEVICE))
            runs.append(model_.forward(x_in, torch.tensor([t], device=DEVICE), shallow=shallow_step).clone())
        outs[key] = runs
    assert all(fused.impls[norm.name] == FUSED for norm in fused.pairs["gn"].values())
    for got, ref in zip(outs["fused"], outs["plain"], strict=True):
        assert rel_err(got, ref) < TOL


def test_candidate_that_does_not_fit_the_gpu_times_infinite(tiny_model, monkeypatch):
    """A candidate whose kernel needs more shared memory than the GPU has (Triton's OutOfResources at its first
    launch) is recorded as infinitely slow and never chosen; the others are timed as usual."""
    from triton.runtime.errors import OutOfResources

    fused = FusedModel(tiny_model("pow2", 6), 2, torch.float32, DEVICE, "triton", "triton")
    conv = fused.op_by_name[next(iter(fused.pairs["gn"]))]

    def fake_time(impl, reps):
        if impl.fuses("gn"):
            raise OutOfResources(300_000, 232_448, "shared memory")
        return 7.0

    monkeypatch.setattr(tuning, "TUNING_CACHE", {})
    monkeypatch.setattr(tuning, "tuning_key", lambda model, op: op.name)
    monkeypatch.setattr(FusedModel, "call", lambda self, op, impl: impl)
    monkeypatch.setattr(tuning, "time_call_us", fake_time)
    names = ("triton", "triton-gn", "triton-k2", "triton-gn-k2")
    times = tuning.candidate_times(fused, conv, tuple(Impl.parse(name) for name in names), 5)
    expected = {"triton": 7.0, "triton-gn": math.inf, "triton-k2": 7.0, "triton-gn-k2": math.inf}
    assert {impl.name: us for impl, us in times.items()} == expected == tuning.TUNING_CACHE[conv.name]
    assert fused.ops_timed == 1


def test_rows_attention_matches_eager(tiny_model):
    """Every attention on the whole-rows schedule (``triton-rows``, which autotune may pick for up to 512 keys), two
    forwards in a row: equal to the eager model."""
    model = tiny_model("attn_pad0", 10).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "cudnn", "triton")
    attentions = [op for op in fused.ops if op.kind == "attention"]
    assert attentions
    for op in attentions:
        fused.impls[op.name] = Impl("triton", rows=True)
    assert_two_forwards_match_eager(fused, model, seed=11)


@pytest.mark.parametrize("rows", [False, True], ids=["stream", "rows"])
def test_tiled_attention_matches_eager(tiny_model, rows):
    """Every attention on a tile other than its default (``triton[-rows]-t...``, the candidates the engine times on
    CUDA and a kernel plan pins; forced here, in the interpreter too): the tile reaches the kernel through the
    engine's call and the forward still equals the eager model."""
    from fastdiff.kernels.attention import attention_tiles

    model = tiny_model("attn_pad0", 12).to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, "cudnn", "triton")
    attentions = [op for op in fused.ops if op.kind == "attention"]
    assert attentions
    for op in attentions:
        q = op.inputs[0].shape
        tile = attention_tiles(op.params["head_dim"], q[2] * q[3], "rows" if rows else "stream")[-1]
        fused.impls[op.name] = Impl("triton", rows=rows, tile=tile)
    assert_two_forwards_match_eager(fused, model, seed=13)


def test_layer_table(tiny_model):
    fused = FusedModel(tiny_model("attn_pad0", 1), 1, torch.float32, DEVICE, "triton", "triton")
    x_in = channels_last_empty(fused.x_in_value.shape, torch.float32, DEVICE).normal_()
    fused.forward(x_in, torch.tensor([5], device=DEVICE))
    rows = fused.layer_table()
    assert len(rows) == len(fused.ops) and all(r["impl"] for r in rows)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"conv", "group_norm", "attention"}  # no copies (concat parts are slices), upsample in the conv


@pytest.mark.parametrize("impls", [pytest.param(("triton", "triton"), marks=pytest.mark.slow), ("cudnn", "sdpa")])
def test_fused_convnext_matches_eager(impls):
    torch.manual_seed(zlib.crc32(str(impls).encode()) % 1000)
    config = ConvNeXtUNetConfig(sample_size=10, in_channels=3, out_channels=2, base_dim=5, dim_mults=(1, 2),
                                attention_heads=2, attention_head_dim=3, gate_reduction=2)  # fmt: skip
    model = ConvNeXtUNet(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.to(DEVICE)
    fused = FusedModel(model, 2, torch.float32, DEVICE, *impls)
    fused.arena.view(torch.float32).fill_(float("nan"))
    x = torch.randn(2, 3, 10, 10).to(DEVICE)
    x_in = channels_last_empty((2, 3, 10, 10), torch.float32, DEVICE).copy_(x)
    out = fused.forward(x_in, torch.tensor([321], device=DEVICE))
    with torch.no_grad():
        ref = model.double().cpu()(x.double().cpu(), torch.tensor([321]))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL
    assert {op.kind for op in fused.ops} == {"conv", "depthwise", "group_norm", "gate", "attention"}
    assert sum(v.concat is not None for v in fused.values) == 2 * len(model.ups)  # gate and h parts: no copies


def test_rejects_other_models_and_bad_input(tiny_model):
    with pytest.raises(FastdiffError, match="fused engine supports DDPMUNet, .*; got Conv2d"):
        FusedModel(torch.nn.Conv2d(1, 1, 1), 1, torch.float32, DEVICE)
    fused = FusedModel(tiny_model("attn_pad0", 2), 2, torch.float32, DEVICE, "triton", "triton")
    with pytest.raises(FastdiffError, match="does not match"):
        fused.forward(torch.zeros(1, 3, 6, 10, device=DEVICE), torch.tensor([1], device=DEVICE))


def test_tuning_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "TUNING_CACHE", {"('conv', ...)": {"triton": 3.5, "cudnn": 2.25}})
    tuning.save_tuning_cache()
    assert tuning.tuning_cache_path() == tmp_path / "engine_tuning.json"
    saved = dict(tuning.TUNING_CACHE)
    tuning.TUNING_CACHE.clear()
    tuning.load_tuning_cache()
    assert tuning.TUNING_CACHE == saved
    (tmp_path / "engine_tuning.json").write_text("{not json")
    tuning.TUNING_CACHE.clear()
    tuning.load_tuning_cache()  # a broken file is ignored (logged)
    assert tuning.TUNING_CACHE == {}


def test_tuning_keys_change_with_the_kernels_source(tmp_path):
    """The tuning cache's keys carry a digest of the kernel modules' source: editing a kernel file (or adding
    one) changes it, so timings of other kernel code are not reused; the installed kernels have one."""
    from fastdiff.engine.tuning import kernels_revision, source_digest

    (tmp_path / "conv.py").write_text("BLOCK_K = 64\n")
    (tmp_path / "notes.txt").write_text("not a module")
    first = source_digest(tmp_path)
    assert source_digest(tmp_path) == first
    (tmp_path / "notes.txt").write_text("still not a module")
    assert source_digest(tmp_path) == first
    (tmp_path / "conv.py").write_text("BLOCK_K = 128\n")
    second = source_digest(tmp_path)
    (tmp_path / "norm.py").write_text("")
    assert len({first, second, source_digest(tmp_path)}) == 3
    assert len(kernels_revision()) == 12 and kernels_revision() == kernels_revision()


def test_step_model_outside_no_grad(tiny_model):
    """The engine runs on a model whose parameters require grad, called outside ``torch.no_grad`` (as a CUDA-graph
    capture does): its time table must not carry autograd history into the ``out=`` row copy."""
    model = tiny_model("attn_pad0", 4).to(DEVICE)
    assert all(p.requires_grad for p in model.parameters())
    fused = FusedModel(model, 1, torch.float32, DEVICE, "triton", "triton")
    timesteps = torch.tensor([999, 500, 1], device=DEVICE)
    step = fused.bind_timesteps(timesteps)
    x_in = channels_last_empty(fused.x_in_value.shape, torch.float32, DEVICE).normal_()
    out = step(x_in, torch.tensor([1], device=DEVICE)).clone()
    ref = fused.forward(x_in, timesteps[1:2])
    assert not out.requires_grad
    # The table row may differ from a one-row table in the last bits (fp32 on the CPU); tf32 dots on the GPU.
    assert rel_err(out, ref) < (1e-5 if DEVICE.type == "cpu" else TOL)
