"""Kernel plans: which implementation each op of a fused forward runs, as a small JSON file.

A plan holds, per GPU model, one *entry* per fused forward it has seen: the forward's structure (a digest of every
op's kind, shapes, layout and flags, plus the dtype) and the choice map ``{op name: implementation name}``
(:mod:`fastdiff.engine.impl`). The engine looks a forward's structure up before it compiles anything:

1. the plan the caller gave (``Engine(plan=...)``, ``--plan FILE``);
2. the plans that ship inside the package (``fastdiff/engine/plans/*.json``), for the GPU by name;
3. the plan the engine wrote earlier on this machine (``$FASTDIFF_CACHE_DIR/plans/<gpu>.json``).

Where one holds the structure, the engine compiles only the kernels it names and times nothing, so it is ready in
seconds, and two processes (or two GPUs of one model) with the same plan run the same kernels and give the same
bytes. Where none does, the engine tunes (times the candidates, ``fastdiff.engine.tuning``) and adds the result to
the cache plan, so every later process uses it. An entry that names an implementation this version lacks, or one
that is not a candidate of its op here, is refused with one log line and the next source is tried (then tuning).

A plan's digest (:meth:`PlanEntry.digest`, 12 hex digits of the choice map) is what PNG parameters and ``generate``'s
manifest record: equal digests, equal kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastdiff.atomic import write_text_atomic
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import Op
from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

FORMAT = "fastdiff-kernel-plan"
VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent / "plans"
"""The plans that ship inside the package, one file per GPU model."""


def cache_dir() -> Path:
    """``$FASTDIFF_CACHE_DIR`` (default ``~/.cache/fastdiff``): where the engine keeps the plans it made."""
    return Path(os.environ.get("FASTDIFF_CACHE_DIR") or Path.home() / ".cache" / "fastdiff")


def gpu_file_name(gpu: str) -> str:
    """A file name for a GPU model name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


def cache_plan_path(gpu: str) -> Path:
    """Where the engine keeps the plan it made for ``gpu``: ``<cache_dir>/plans/<gpu file name>.json``."""
    return cache_dir() / "plans" / f"{gpu_file_name(gpu)}.json"


def structure_digest(ops: Iterable[Op], dtype: str, extra: Mapping[str, object] | None = None) -> str:
    """16 hex digits of what an op's choice depends on besides the GPU: each op's name, kind, input and output
    shapes, strided-or-not layout, stage and flags (an fp8 scale or a time embedding only as present), the dtype,
    and ``extra`` (e.g. which fusions pair which ops). Equal digests: the same candidates for every op."""
    rows = []
    for op in ops:
        params = {k: (v is not None if k in ("temb", "fp8_scale") else v) for k, v in op.params.items()}
        values = [(v.shape, v.concat is not None, v.fp8) for v in (*op.inputs, op.output)]
        rows.append((op.name, op.kind, op.stage, values, sorted(params.items())))
    payload = repr((rows, dtype, sorted((extra or {}).items())))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class PlanEntry:
    """The choice for one fused forward: ``choices`` {op name: implementation name}; ``label`` says what it is
    (model, role, batch, size, dtype) for a reader; ``made_by`` how it was made (tuned: versions, date, reps)."""

    choices: dict[str, str]
    label: str = ""
    made_by: dict[str, object] = field(default_factory=dict)

    def digest(self) -> str:
        """12 hex digits of the choice map: equal digests, equal kernels."""
        return hashlib.sha256(json.dumps(self.choices, sort_keys=True).encode()).hexdigest()[:12]

    def impls(self) -> dict[str, Impl]:
        """The choice map as :class:`~fastdiff.engine.impl.Impl` values (a FastdiffError for a name this version
        does not know)."""
        return {op: Impl.parse(name) for op, name in self.choices.items()}

    def to_json(self) -> dict:
        return {"label": self.label, "made_by": self.made_by, "choices": dict(sorted(self.choices.items()))}


@dataclass
class KernelPlan:
    """Plan entries for one GPU model, keyed by :func:`structure_digest`."""

    gpu: str
    entries: dict[str, PlanEntry] = field(default_factory=dict)

    def lookup(self, gpu: str, structure: str) -> PlanEntry | None:
        """The entry for ``structure`` on ``gpu`` (None if this plan is for another GPU or lacks it)."""
        return self.entries.get(structure) if gpu == self.gpu else None

    def add(self, structure: str, entry: PlanEntry) -> None:
        self.entries[structure] = entry

    def to_json(self) -> dict:
        entries = {k: e.to_json() for k, e in sorted(self.entries.items())}
        return {"format": FORMAT, "version": VERSION, "gpu": self.gpu, "entries": entries}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON (all or nothing)."""
        return write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: object, source: str = "plan") -> KernelPlan:
        """A plan from its JSON form; a one-line FastdiffError for anything else (names are checked where used)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise FastdiffError(f'{source} is not a fastdiff kernel plan (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise FastdiffError(f"{source} is a kernel plan of version {data.get('version')!r}; this fastdiff reads "
                                f"version {VERSION}")  # fmt: skip
        gpu, entries = data.get("gpu"), data.get("entries")
        if not isinstance(gpu, str) or not isinstance(entries, dict):
            raise FastdiffError(f'{source}: a kernel plan needs a "gpu" name and an "entries" object')
        plan = cls(gpu)
        for structure, raw in entries.items():
            choices = raw.get("choices") if isinstance(raw, dict) else None
            if not isinstance(choices, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in choices.items()
            ):
                raise FastdiffError(f'{source}: entry {structure!r} needs "choices": {{op name: implementation}}')
            plan.add(structure, PlanEntry(dict(choices), str(raw.get("label", "")), dict(raw.get("made_by") or {})))
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KernelPlan:
        """Read a plan file; a one-line FastdiffError for a missing, unreadable or malformed one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FastdiffError(f"kernel plan {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise FastdiffError(f"kernel plan {path} cannot be read: {exc}") from None
        return cls.from_json(data, f"kernel plan {path}")


def shipped_plans() -> list[KernelPlan]:
    """The plans inside the package (a broken one is skipped with a log line, never fatal)."""
    plans = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        try:
            plans.append(KernelPlan.load(path))
        except FastdiffError as exc:
            log.warning("skipping a shipped plan: %s", exc)
    return plans


def load_cache_plan(gpu: str) -> KernelPlan:
    """The plan the engine made earlier on this machine for ``gpu`` (empty if none or unreadable)."""
    path = cache_plan_path(gpu)
    if not path.is_file():
        return KernelPlan(gpu)
    try:
        plan = KernelPlan.load(path)
    except FastdiffError as exc:
        log.warning("ignoring the cached plan: %s", exc)
        return KernelPlan(gpu)
    return plan if plan.gpu == gpu else KernelPlan(gpu)


def save_to_cache(gpu: str, structure: str, entry: PlanEntry) -> None:
    """Add ``entry`` to the cache plan of ``gpu`` (re-read first, so concurrent processes lose nothing but a race
    between their writes; a write failure is a log line, not an error)."""
    plan = load_cache_plan(gpu)
    plan.add(structure, entry)
    try:
        plan.save(cache_plan_path(gpu))
    except OSError as exc:
        log.warning("could not write the kernel plan cache %s: %s", cache_plan_path(gpu), exc)


def find_entries(gpu: str, structure: str, given: KernelPlan | None = None) -> list[tuple[PlanEntry, str]]:
    """The entries for ``structure`` on ``gpu``, each with where it came from, in the order the engine tries them:
    the given plan's, a shipped plan's, the cache plan's."""
    found = []
    if given is not None and (entry := given.lookup(gpu, structure)) is not None:
        found.append((entry, "given"))
    for plan in shipped_plans():
        if (entry := plan.lookup(gpu, structure)) is not None:
            found.append((entry, "shipped"))
    if (entry := load_cache_plan(gpu).lookup(gpu, structure)) is not None:
        found.append((entry, "cache"))
    return found
