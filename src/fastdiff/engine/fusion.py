"""Fusions: a conv and a partner op run in one launch, timed by the autotune against the two run apart; and
:class:`BoundModel`, what the executor's parts (fusions, candidates, calls, tuning) read of a fused model.

A fusion is one module holding a :class:`Fusion` instance (``engine/shortcut.py``: a ResnetBlock2D's 1x1
conv_shortcut summed into its conv2; ``engine/epilogue_norm.py``: the GroupNorm of a conv's output, or its
statistics, in the conv's epilogue), registered in :data:`fastdiff.engine.executor.FUSIONS`, with its tag (the part
its implementations' names carry, ``triton-sc``) in :data:`fastdiff.engine.impl.FUSION_TAGS`. The engine asks it:

* :meth:`Fusion.pairs`: the (conv, partner) pairs of a lowered op list it can take, ``{conv name: partner op}`` (the
  executor keeps a pair where both ops run in the step cache's shallow forward or neither does);
* :meth:`Fusion.variants`: the conv implementations that run it, added to the conv's candidates (CUDA only);
* :meth:`Fusion.conv_args`: the kernel arguments of a conv launch that runs it;
* :attr:`Fusion.partner_impl` / :attr:`Fusion.partner_why`: what the partner runs as meanwhile (``fused``: no launch;
  ``apply``: a lighter form of its own) and why, in the layer table;
* :meth:`Fusion.access`: a value the fused launch also reads or writes, which the arena plan keeps live at the conv;
* :meth:`Fusion.key_params`: what the fused candidates' timings depend on beyond the conv (tuning-cache key);
* :meth:`Fusion.partner_us` / :meth:`Fusion.fused_partner_us`: the partner's time apart at its best and while the
  conv runs the fusion, so that the autotune compares the pair, not the conv alone;
* :attr:`Fusion.in_first_forward`: whether the streamed first forward may run it (False where the partner's weights
  arrive after the conv's launch);
* :meth:`Fusion.saved_bytes`: the bytes the fused pair does not move (``fastdiff.bench.ops``'s op table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fastdiff.engine.impl import FUSED, Impl
from fastdiff.engine.ir import Op, Value
from fastdiff.engine.weights import WeightStreamer
from fastdiff.kernels.common import SplitWorkspace


class BoundModel(Protocol):
    """What the executor's parts read and write of a :class:`fastdiff.engine.executor.FusedModel` (which is the one
    implementation): its settings, ops, fusion pairs, choice map, bound tensors and device weights."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    conv_impl: str
    attention_impl: str
    ops: list[Op]
    fusions: tuple[Fusion, ...]
    pairs: dict[str, dict[str, Op]]
    """By fusion tag: ``{conv name: partner op}``."""
    impls: dict[str, Impl]
    """The choice map: op name -> its implementation."""
    device_weights: dict[str, dict[str, torch.Tensor]]
    streamer: WeightStreamer
    """Uploads the device weights; ``wait(op name)`` orders the current stream after that op's copies."""
    fusion_state: dict[str, dict[str, Any]]
    """By fusion tag: buffers a fusion keeps per model (the pair biases, the statistics)."""
    tap_partials: dict[str, torch.Tensor]
    split_workspace: SplitWorkspace
    temb_row: torch.Tensor
    ops_timed: int

    def tensor(self, v: Value) -> torch.Tensor: ...

    def call(self, op: Op, impl: Impl) -> Callable[[], None]: ...


class Fusion:
    """The base of a fusion (see the module docstring); subclasses set ``tag`` and implement :meth:`pairs`,
    :meth:`variants` and :meth:`conv_args`, and override the rest where their pair differs."""

    tag: str = ""
    partner_impl: Impl = FUSED
    partner_why: str = "in {}'s launch"
    """The partner's ``why`` while its conv runs the fusion (``{}``: the conv's name)."""
    in_first_forward: bool = True

    def pairs(self, ops: list[Op]) -> dict[str, Op]:
        """``{name of the conv: its partner op}`` for every pair of ``ops`` the fusion can take."""
        raise NotImplementedError

    def variants(self, model: BoundModel, conv: Op, partner: Op, ours: tuple[Impl, ...]) -> tuple[Impl, ...]:
        """The implementations of ``conv`` that run the fusion, given its other Triton candidates so far
        (``ours``)."""
        raise NotImplementedError

    def conv_args(self, model: BoundModel, conv: Op, partner: Op) -> dict[str, Any]:
        """Keyword arguments of the conv kernel's call when it runs the fusion (they replace the plain call's).
        Called when the call is built, possibly before the weights' uploads have landed: device work on
        ``model.device_weights`` here waits on ``model.streamer`` first (``shortcut.summed_bias``)."""
        raise NotImplementedError

    def access(self, partner: Op) -> Value | None:
        """A value the conv's launch also reads or writes when it runs the fusion (None: none)."""
        return None

    def key_params(self, model: BoundModel, partner: Op) -> dict[str, Any]:
        """Tuning-key entries of the conv: what its fused candidates' times depend on beyond its own shapes."""
        return {}

    def partner_us(self, model: BoundModel, conv: Op, partner: Op, reps: int) -> float | None:
        """Microseconds of ``partner`` on its own; None (the default): its best over its own candidates, which the
        autotune times (or takes from the tuning cache)."""
        return None

    def fused_partner_us(
        self, model: BoundModel, conv: Op, partner: Op, effective: dict[Impl, float], reps: int
    ) -> float:
        """Microseconds of ``partner`` while ``conv`` runs the fusion (``effective``: the conv's candidates' times
        so far, in candidate order); 0 for a partner that launches nothing."""
        return 0.0

    def saved_bytes(self, partner: Op, elem_bytes: int) -> int:
        """Bytes the fused launch does not move that the pair apart would (none unless overridden)."""
        return 0
