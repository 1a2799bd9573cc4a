"""An op's implementation as a value: which kernel runs the op and in which form.

Candidates, the autotune's choice, the tuning cache, the layer table and the bench's op tables all name an
implementation by a string, :attr:`Impl.name`; :class:`Impl` is what that string means, and :meth:`Impl.parse` is the
one place that reads one. The names (canonical: ``Impl.parse(name).name == name``)::

    triton[-sc][-gn|-st][-k<N>]   the op kind's own Triton kernel (a conv's: the gather conv, kernels.conv2d); fusions
                                  with a partner op (FUSION_TAGS, in that order: -sc the 1x1 conv_shortcut summed into
                                  the reduction, -gn the output's GroupNorm in the epilogue, -st its statistics); -k<N>
                                  the reduction split over N programs
    triton-kv<N> | triton-rows    attention: the keys split over N programs per query block | whole score rows
    triton-c<L>                   GroupNorm: whole groups on L channel lanes per program
    triton[-kv<N>|-rows]-t<A>x<B>x...  attention (4 numbers) or token GEMM (5): the kernel's tile, as
                                  ``kernels.attention.attention_tiles`` / ``kernels.linear.linear_tiles`` list
                                  them (without -t: the first, the default)
    triton-tma[-fp8][-k<N>]       the TMA conv (Hopper): e4m3 operands, split-K; a token GEMM's: the TMA form of
                                  kernels.linear (``tma=True``; -fp8: e4m3 operands), also on a tile
                                  ``-t<BMxBNxBKxWxS>``
    triton-taps                   the tap-sum conv (few output channels)
    gluon[-p2][-sc]               the Gluon TMA conv: persistent with two programs per SM, the shortcut summed in
    cudnn | cublas | sdpa | torch the vendor library (conv and depthwise | token GEMM | attention), torch (center)
    fused                         no launch of its own: runs inside its partner's (a shortcut summed in its conv2, a
                                  GroupNorm in its producer's epilogue)
    apply                         a GroupNorm as one pass over the statistics its producer's epilogue wrote

A forward's choice is the map ``{op name: Impl}`` (``FusedModel.impls``); :func:`impl_names` / :func:`impls_from_names`
convert it to and from its JSON form.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fastdiff.errors import FastdiffError

KERNELS = ("triton", "triton-tma", "triton-taps", "gluon", "cudnn", "cublas", "sdpa", "torch", "fused", "apply")
"""The kernels an implementation names (``Impl.kernel``); "triton" is the op kind's own Triton kernel."""
FUSION_TAGS = ("sc", "gn", "st")
"""The name parts of the fusions a conv implementation may run (``Impl.fusions``), in name order: the tags of the
fusions of :data:`fastdiff.engine.executor.FUSIONS`. A new fusion adds its tag here."""
EXCLUSIVE_FUSIONS = (frozenset({"gn", "st"}),)
"""Fusions no implementation runs together (both are the output's GroupNorm)."""

_NAME = re.compile(
    r"(?P<kernel>triton-tma|triton-taps|[a-z]+)(?P<fp8>-fp8)?(?P<p2>-p2)?"
    rf"(?P<fusions>(?:-(?:{'|'.join(FUSION_TAGS)}))*)"
    r"(?:-k(?P<k>\d+)|-kv(?P<kv>\d+)|(?P<rows>-rows)|-c(?P<c>\d+))?"
    r"(?:-t(?P<tile>\d+(?:x\d+){3,4}))?"
)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op (see the module docstring for the names).

    ``kernel``: one of :data:`KERNELS`; ``fusions``: the :data:`FUSION_TAGS` it runs with its partner ops (the gather
    conv: any; the Gluon conv: "sc"); ``split_k``: reduction split (the gather and the TMA conv); ``split_kv``,
    ``rows``: attention's schedules; ``lanes``: a GroupNorm's channel lanes per program; ``fp8``: the TMA conv on e4m3
    operands; ``programs_per_sm``: 2 for the persistent Gluon conv; ``tile``: the attention kernel's (BLOCK_M,
    BLOCK_N | BLOCK_DV, warps, stages) or the token GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), () for the
    kernel's default. A combination no kernel has is a FastdiffError.
    """

    kernel: str
    fusions: tuple[str, ...] = ()
    split_k: int = 1
    split_kv: int = 1
    rows: bool = False
    lanes: int | None = None
    fp8: bool = False
    programs_per_sm: int = 1
    tile: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        why = self._invalid()
        if why is not None:
            raise FastdiffError(f"invalid implementation {self!r}: {why}")

    def _invalid(self) -> str | None:
        if self.kernel not in KERNELS:
            return f"kernel must be one of {KERNELS}"
        if not isinstance(self.fusions, tuple) or any(tag not in FUSION_TAGS for tag in self.fusions):
            return f"fusions must be a tuple of {FUSION_TAGS}"
        if list(self.fusions) != sorted(set(self.fusions), key=FUSION_TAGS.index):
            return f"fusions once each, in the order {FUSION_TAGS}"
        if any(group <= set(self.fusions) for group in EXCLUSIVE_FUSIONS):
            return "the output's GroupNorm (gn) and its statistics (st) are two forms of one fusion"
        if self.fusions and not (self.kernel == "triton" or self.kernel == "gluon" and self.fusions == ("sc",)):
            return "fusions run on the gather conv (triton) or, the shortcut only, the Gluon conv"
        if not (_positive(self.split_k) and _positive(self.split_kv) and (self.lanes is None or _positive(self.lanes))):
            return "split_k and split_kv are positive ints, lanes None or one"
        if self.split_k > 1 and self.kernel not in ("triton", "triton-tma"):
            return "split_k is the gather or the TMA conv's"
        schedules = (self.split_k > 1 or bool(self.fusions), self.split_kv > 1, self.rows, self.lanes is not None)
        if sum(schedules) > 1 or (any(schedules[1:]) and self.kernel != "triton"):
            return "one of: fusions / split_k (convs), split_kv, rows (attention), lanes (GroupNorm); Triton's own"
        if self.fp8 and self.kernel != "triton-tma":
            return "fp8 is the TMA conv's"
        if self.programs_per_sm not in (1, 2) or (self.programs_per_sm == 2 and self.kernel != "gluon"):
            return "programs_per_sm is 1, or 2 for the Gluon conv"
        if not isinstance(self.tile, tuple) or (
            self.tile and not (len(self.tile) in (4, 5) and all(map(_positive, self.tile)))
        ):
            return "tile is () or 4 or 5 positive ints"
        tma_gemm = self.kernel == "triton-tma" and len(self.tile) == 5 and self.split_k == 1
        if self.tile and not tma_gemm and (self.kernel != "triton" or schedules[0] or self.lanes is not None):
            return "a tile is the Triton attention or token GEMM kernel's (no fusions, split_k or lanes)"
        if len(self.tile) == 5 and (self.rows or self.split_kv > 1):
            return "an attention schedule's tile has 4 numbers (a token GEMM's 5)"
        return None

    @property
    def name(self) -> str:
        """The string form (tuning-cache entries, the layer table, result JSON)."""
        parts = [self.kernel, *(["fp8"] if self.fp8 else []), *(["p2"] if self.programs_per_sm == 2 else [])]
        parts += self.fusions
        if self.split_k > 1:
            parts.append(f"k{self.split_k}")
        if self.split_kv > 1:
            parts.append(f"kv{self.split_kv}")
        if self.rows:
            parts.append("rows")
        if self.lanes is not None:
            parts.append(f"c{self.lanes}")
        if self.tile:
            parts.append("t" + "x".join(map(str, self.tile)))
        return "-".join(parts)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> Impl:
        """The implementation named ``name`` (the module docstring's names); a one-line FastdiffError for any other
        string."""
        match = _NAME.fullmatch(name) if isinstance(name, str) else None
        impl = None
        if match is not None:
            g = match.groupdict()
            try:
                impl = cls(
                    g["kernel"],
                    fusions=tuple(g["fusions"].split("-")[1:]),
                    split_k=int(g["k"] or 1),
                    split_kv=int(g["kv"] or 1),
                    rows=g["rows"] is not None,
                    lanes=int(g["c"]) if g["c"] is not None else None,
                    fp8=g["fp8"] is not None,
                    programs_per_sm=2 if g["p2"] else 1,
                    tile=tuple(int(x) for x in g["tile"].split("x")) if g["tile"] else (),
                )
            except FastdiffError:
                impl = None
        if impl is None or impl.name != name:
            raise FastdiffError(
                f"unknown implementation {name!r}: expected e.g. triton, triton-sc-gn-k4, triton-tma-fp8-k2, "
                "gluon-p2-sc, cudnn (fastdiff.engine.impl)"
            )
        return impl

    @property
    def launches(self) -> bool:
        """Whether the op launches anything of its own (not ``fused``)."""
        return self.kernel != "fused"

    def fuses(self, tag: str) -> bool:
        """Whether this implementation runs the fusion ``tag`` (one of :data:`FUSION_TAGS`)."""
        return tag in self.fusions

    def with_fusion(self, tag: str) -> Impl:
        """This implementation also running the fusion ``tag`` (its place in the name by :data:`FUSION_TAGS`)."""
        return dataclasses.replace(self, fusions=tuple(t for t in FUSION_TAGS if t == tag or t in self.fusions))

    def without_fusion(self, tag: str) -> Impl:
        """This implementation without the fusion ``tag``."""
        return dataclasses.replace(self, fusions=tuple(t for t in self.fusions if t != tag))


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


TRITON = Impl("triton")
FUSED = Impl("fused")
APPLY = Impl("apply")


def impl_names(impls: Mapping[str, Impl]) -> dict[str, str]:
    """A choice map ``{op name: Impl}`` as JSON-ready names."""
    return {op: impl.name for op, impl in impls.items()}


def impls_from_names(names: Mapping[str, str]) -> dict[str, Impl]:
    """The choice map of :func:`impl_names`'s output (a FastdiffError for an unknown name)."""
    return {op: Impl.parse(name) for op, name in names.items()}
