"""``fastdiff generate``: bulk generation into a folder, alone or under ``torchrun``, resumable.

Unconditional models: seeds S..S+N-1, one ``SEED.png`` each. The seeds are cut into fixed chunks of ``batch``
seeds counted from the first seed (with ``--format npz``: into shards of ``shard_size`` seeds, each sampled in
chunks of ``batch`` from the shard's start). The chunks (shards) still missing are dealt round-robin to the ranks,
so every image is computed in the same batch as in a one-process run and the files are byte-identical whatever
the number of processes. Each file is written atomically, so a killed job leaves whole files only and a rerun
skips them. ``manifest.json`` records what made the folder (model hash, sampler, steps, dtype, image size,
format, versions); a rerun with other settings is refused. Rank 0 writes ``manifest.json`` and ``summary.json``
(images/s per rank and in all).

Text-to-image models take ``--prompts FILE``, and the job is a list of images 0..N-1, each with its own prompt,
negative prompt, guidance scale and seed, written as ``INDEX.png`` (``000000.png``, ``000001.png``, ...: named by
image index, since seeds may repeat across lines). The file is either plain text, one prompt per line, or JSONL
(its first non-blank line starts with ``{``): one JSON object per line with ``prompt`` and optional
``negative_prompt``, ``seed``, ``guidance`` and ``n`` (images of that line, default 1). Blank lines are skipped,
plain-text prompts are stripped of surrounding white space; line numbers in errors count every line of the file.
The file's images, line by line (``n`` each), make a list of L images; ``--num-images N`` (default L) takes the
first N of that list, repeated as often as needed: image i is entry i mod L. Image i's seed is ``first_seed + i``,
or, on a line that gives ``seed``, s + k for the line's k-th image (``s, s+1, ...``, counted over repeats too);
lines without ``guidance`` (``negative_prompt``) take ``--guidance`` (``--negative-prompt``). A job's images
must be all guided (> 1) or all unguided (<= 1): the pipeline cannot mix them in one batch. Chunks of ``batch``
images count from image 0 and are sampled whole at that size (the last may be shorter) on whichever rank, so the
bytes do not depend on the number of processes here either. The manifest records the file's sha256, the
prompts as read, ``--first-seed``, ``--guidance`` and ``--negative-prompt``: a rerun with another file or other
defaults is refused. Each PNG records its parameters (prompt, negative prompt, seed, guidance, sampler, steps,
size, dtype, model, fastdiff version, kernel plan digest) in its ``parameters`` text chunk. Only PNG output.

Files, and what a crash leaves. Each round queues a unit's sampling, converts it to uint8 on the device and
starts its copy into pinned host memory without waiting, hands it to the writer and only then waits for the
previous unit's files, so the GPU samples unit r while the host writes unit r-1. The writer encodes a unit's PNGs
in a pool of threads (zlib runs without the GIL) straight into temporary files ``.NAME.RANDOM.tmp``, then makes
them durable together (one ``syncfs`` of the folder's filesystem on Linux, which flushes whatever else is
waiting to be written there too; elsewhere an fsync per file), then renames
each onto its name and fsyncs the folder once; only then does the unit count as done (progress, summary). A
name therefore appears only after its bytes are on disk: after a kill or a power cut every ``NNNNNN.png`` (and
shard) is whole, the rerun trusts the files it finds without reading them, redoes the missing ones and deletes
the leftover temporary files. A unit whose encoding or writing fails publishes none of its files.

Under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK set) each rank joins torch.distributed and uses
``cuda:LOCAL_RANK``; the ranks exchange only small Python objects (the plan, the rounds' reports), through gloo
(beside a caller's NCCL group, where one was set up already). Several nodes
(``torchrun --nnodes N --node-rank K --master-addr ... --master-port ...`` on each) work the same way: the global
ranks share the chunks, and the output folder must be one that every node sees (rank 0 alone writes the manifest
and the summary): before sampling, every rank looks there for an empty file that rank 0 made, and the job stops in
one line if one does not see it. A process or node that dies, or does not answer within ``--timeout``, fails
every collective: the processes left stop with one line (printed by the first process of each node, since rank 0
may be the one gone), keep their whole files, and rerunning the same command on every node completes the job.

Every bad input (settings, the prompts file: line by line) fails in one line before any model loads.
The module imports torch and numpy where they are used, so ``fastdiff generate --help`` answers at once.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import hashlib
import io
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import fastdiff
from fastdiff.atomic import (
    check_output_location,
    flush_to_disk,
    fsync_folder,
    publish,
    write_temporary,
    write_text_atomic,
)
from fastdiff.cli_args import (
    DEFAULT_GUIDANCE,
    DTYPE_CHOICES,
    DTYPE_HELP,
    DTYPES,
    FULL_GUIDANCE,
    MAX_SEED,
    SAMPLERS,
    check_guidance_interval,
    resolve_dtype_choice,
)
from fastdiff.errors import FastdiffError
from fastdiff.images import pil_image, png_bytes, uint8_pixels
from fastdiff.prompts_file import PromptLine, read_prompts

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

FORMATS = ("png", "npz")
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
RANDOM_INIT_SEED = 0
"""Presets without shipped weights are initialised from this torch seed, so every rank holds the same model."""
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin")
IDENTITY_KEYS = (
    "model_hash",
    "sampler",
    "steps",
    "dtype",
    "image_size",
    "channels",
    "format",
    "shard_size",
    "fastdiff_version",
    "torch_version",
)
"""Manifest fields that must match before a rerun adds images to a folder."""
PROMPT_IDENTITY_KEYS = ("prompts_sha256", "first_seed", "guidance", "negative_prompt", "guidance_interval")
"""The same for a ``--prompts`` job (absent from an unconditional job's manifest): image i's prompt, seed and
guidance follow from these, whatever ``--num-images``. ``guidance_interval`` is recorded only when it is not every
step (so folders made before it existed still match)."""
PNG_NAME = re.compile(r"(\d+)\.png")
SHARD_NAME = re.compile(r"(\d+)-(\d+)\.npz")
WRITER_THREADS = 8
"""The most PNG encoder threads of one process (``writer_threads``)."""
SHARED_FOLDER_WAIT_S = 30.0
"""How long a rank waits to see rank 0's probe file in ``--out-dir`` (a network filesystem may show it late)."""
TEMP_NAME = re.compile(r"\.(\d+\.png|\d+-\d+\.npz|manifest\.json|summary\.json)\..+")
"""Temporary files of an atomic write (``.NAME.XXXX``) that a killed job may have left."""

PROMPT_WARNINGS_LOGGER = "fastdiff.models.stable_diffusion"
"""Where the text-to-image pipeline logs a prompt's problems, at each call that holds the prompt."""

T = TypeVar("T")


class JobError(FastdiffError):
    """An error that every rank of the job raises alike (after a collective); rank 0 reports it."""


class LostRanks(JobError):
    """A collective failed: another process (or a whole node) died, or did not answer within ``--timeout``.

    Rank 0 may be the one that is gone, so the first process of each node (LOCAL_RANK 0) reports it."""


@dataclass
class GenerateConfig:
    """What ``generate`` makes: seeds ``first_seed .. first_seed + num_images - 1`` of ``model`` in ``out_dir``, or
    with ``prompts`` (a text-to-image model) images 0..num_images-1 of the prompts file (``num_images`` None: as
    many as the file lists)."""

    model: str
    num_images: int | None
    out_dir: Path
    first_seed: int = 0
    sampler: str = "ddim"
    steps: int = 100
    dtype: str = "fp32"
    device: str = "auto"
    batch: int = 64
    image_format: str = "png"
    shard_size: int = 1000
    timeout_s: float = 1800.0
    progress: bool = True
    plan: Path | None = None
    prompts: Path | None = None
    guidance: float = DEFAULT_GUIDANCE
    negative_prompt: str = ""
    guidance_interval: tuple[float, float] = FULL_GUIDANCE


@dataclass
class RankStats:
    """One rank's share of a run. ``queue_seconds``: time the sampling thread spent handing units to the GPU and
    the writer (it returns once the work is queued, so this grows when the GPU is the limit and the queue is
    full); ``write_wait_seconds``: time it then waited for the previous unit's files (the host's writing is the
    limit where this is large)."""

    rank: int
    device: str
    images: int
    seconds: float
    queue_seconds: float = 0.0
    write_wait_seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass
class GenerateSummary:
    """What a run did: images written now and found from earlier runs, wall time and throughput per rank."""

    out_dir: str
    rank: int
    num_images: int
    written: int
    already_present: int
    world_size: int
    setup_seconds: float
    seconds: float
    ranks: list[RankStats] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        del record["rank"]
        record["images_per_s"] = round(self.images_per_s, 3)
        record["setup_seconds"] = round(self.setup_seconds, 3)
        record["seconds"] = round(self.seconds, 3)
        for stats, entry in zip(self.ranks, record["ranks"], strict=True):
            for key in ("seconds", "queue_seconds", "write_wait_seconds"):
                entry[key] = round(getattr(stats, key), 3)
            entry["images_per_s"] = round(stats.images_per_s, 3)
        return record


@dataclass(frozen=True)
class Unit:
    """A run of consecutive file numbers that one rank samples and writes: one chunk (png) or one shard (npz).
    The numbers are seeds, or image indices in a ``--prompts`` job (``noun`` "images")."""

    start: int
    stop: int
    noun: str = "seeds"

    def chunks(self, batch: int) -> list[list[int]]:
        """The batches, ``batch`` numbers each counted from ``start`` (the last may be shorter)."""
        return [list(range(s, min(s + batch, self.stop))) for s in range(self.start, self.stop, batch)]

    @property
    def label(self) -> str:
        return f"{self.noun} {self.start}-{self.stop - 1}"


def png_name(number: int) -> str:
    """``000042.png``: the file of seed 42, or of image 42 in a ``--prompts`` job."""
    return f"{number:06d}.png"


def shard_name(unit: Unit) -> str:
    return f"{unit.start:06d}-{unit.stop - 1:06d}.npz"


# --- files --------------------------------------------------------------------------------------------------


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(record, indent=2) + "\n")


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed ``.npz`` whose bytes depend on the arrays only (``np.savez`` stamps the current time)."""
    import numpy as np

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


# --- prompts -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpec:
    """Everything that makes image ``index`` of a ``--prompts`` job."""

    index: int
    prompt: str
    negative_prompt: str
    guidance: float
    seed: int


@dataclass
class PromptJob:
    """The images of a prompts file: image i is entry ``i mod L`` of the L images its lines list (``n`` each)."""

    path: Path
    sha256: str
    lines: list[PromptLine]
    num_images: int
    first_seed: int
    guidance_interval: tuple[float, float] = FULL_GUIDANCE
    """The guided steps of every image (``TextToImagePipeline``'s ``guidance_interval``)."""
    starts: list[int] = field(init=False)
    """Where each line's images begin in the list of L."""

    def __post_init__(self) -> None:
        self.starts = []
        total = 0
        for entry in self.lines:
            self.starts.append(total)
            total += entry.n

    @property
    def listed(self) -> int:
        """L: the images the file lists, each line's ``n``."""
        return self.starts[-1] + self.lines[-1].n

    def image(self, index: int) -> ImageSpec:
        repeat, position = divmod(index, self.listed)
        line_index = bisect.bisect_right(self.starts, position) - 1
        entry = self.lines[line_index]
        if entry.seed is None:
            seed = self.first_seed + index
        else:
            seed = entry.seed + repeat * entry.n + position - self.starts[line_index]
        return ImageSpec(index, entry.prompt, entry.negative_prompt, entry.guidance, seed)

    def images(self, indices: list[int]) -> list[ImageSpec]:
        return [self.image(i) for i in indices]

    def images_of_line(self, line_index: int) -> int:
        """How many of the job's ``num_images`` come from ``lines[line_index]``."""
        repeats, rest = divmod(self.num_images, self.listed)
        start = self.starts[line_index]
        return repeats * self.lines[line_index].n + min(max(rest - start, 0), self.lines[line_index].n)

    def check(self) -> None:
        """Every seed is in range and the images are all guided or all unguided (one-line error naming the line)."""
        used = [k for k in range(len(self.lines)) if self.images_of_line(k) > 0]
        for k in used:
            entry = self.lines[k]
            last = None if entry.seed is None else entry.seed + self.images_of_line(k) - 1
            if last is not None and last > MAX_SEED:
                raise FastdiffError(
                    f"--prompts {self.path} line {entry.line}: seed {entry.seed} with {self.images_of_line(k)} "
                    f"images goes past the largest seed {MAX_SEED}"
                )
        first = self.lines[used[0]]
        for k in used:
            entry = self.lines[k]
            if (entry.guidance > 1) != (first.guidance > 1):
                kinds = {True: "guided (> 1)", False: "unguided (<= 1)"}
                raise FastdiffError(
                    f"--prompts {self.path} line {entry.line}: guidance {entry.guidance:g} is "
                    f"{kinds[entry.guidance > 1]} but line {first.line}'s {first.guidance:g} is "
                    f"{kinds[first.guidance > 1]}: a job's images must be all guided or all unguided "
                    "(split the file into two jobs)"
                )

    def manifest_record(self) -> list[dict[str, Any]]:
        """The prompts as read (defaults filled in), for ``manifest.json``."""
        return [asdict(entry) for entry in self.lines]


def load_prompt_job(config: GenerateConfig) -> PromptJob | None:
    """The ``--prompts`` job of ``config`` (checked: seeds, guidance), None without ``--prompts``."""
    if config.prompts is None:
        return None
    lines, digest = read_prompts(config.prompts, config.guidance, config.negative_prompt)
    listed = sum(entry.n for entry in lines)
    num_images = listed if config.num_images is None else config.num_images
    job = PromptJob(config.prompts, digest, lines, num_images, config.first_seed, config.guidance_interval)
    job.check()
    return job


# --- ranks ---------------------------------------------------------------------------------------------------


class Ranks:
    """This process's place in the job: rank, world size, device; collectives are no-ops for one process.

    The collectives pass Python objects through gloo (the group this class starts, or ``objects_group`` beside a
    caller's NCCL group), so that a round's report neither waits behind the sampling queued on the GPU nor holds up
    the next one."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: str,
        owns_group: bool,
        objects_group: Any = None,
        timeout_s: float = GenerateConfig.timeout_s,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.owns_group = owns_group
        self.objects_group = objects_group
        self.timeout_s = timeout_s

    @classmethod
    def start(cls, device: str, timeout_s: float) -> Ranks:
        """Join torch.distributed when launched by torchrun (RANK/WORLD_SIZE set); else a single process."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return cls(0, 1, device, owns_group=False)
        import torch.distributed as dist

        from fastdiff.devices import rank_device

        device = rank_device(device, "generate under torchrun")
        owns_group = not dist.is_initialized()
        timeout = datetime.timedelta(seconds=timeout_s)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        try:
            if owns_group:  # the ranks exchange only small Python objects: gloo, also between GPUs (no NCCL setup)
                dist.init_process_group("gloo", timeout=timeout)
            objects_group = None
            if dist.get_backend() != "gloo":  # a caller's NCCL group: the objects go through gloo beside it
                objects_group = dist.new_group(backend="gloo", timeout=timeout)
        except Exception as exc:  # the rendezvous or a connection to a peer failed, or timed out
            raise LostRanks(lost_ranks_message(rank, world_size, timeout_s, exc, "could not join")) from exc
        return cls(dist.get_rank(), dist.get_world_size(), device, owns_group, objects_group, timeout_s)

    def collective(self, call: Callable[[], T]) -> T:
        """``call()`` (a collective); a failure (a peer died, or hung past the timeout) raises :class:`LostRanks`."""
        try:
            return call()
        except Exception as exc:
            raise LostRanks(lost_ranks_message(self.rank, self.world_size, self.timeout_s, exc)) from exc

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        self.collective(lambda: dist.all_gather_object(gathered, obj, group=self.objects_group))
        return gathered

    def on_rank0(self, action: Callable[[], T]) -> T:
        """Run ``action`` on rank 0 and hand its result (or its error, raised on every rank) to all ranks."""
        outcome: list[Any] = [None, None]
        if self.rank == 0:
            try:
                outcome = [action(), None]
            except FastdiffError as exc:
                outcome = [None, str(exc)]
            except Exception as exc:
                log.exception("rank 0 failed while preparing the job")
                outcome = [None, f"rank 0 failed while preparing the job: {one_line(exc)}"]
        if self.world_size > 1:
            import torch.distributed as dist

            self.collective(lambda: dist.broadcast_object_list(outcome, src=0, group=self.objects_group))
        if outcome[1] is not None:
            raise JobError(outcome[1])
        return outcome[0]

    def agree(self, error: str | None) -> None:
        """Every rank passes its error or None; if any rank failed, all raise naming the first that did."""
        for rank, message in enumerate(self.gather(error)):
            if message is not None:
                raise JobError(message if self.world_size == 1 else f"rank {rank}: {message}")

    def close(self, together: bool = False) -> None:
        """Leave torch.distributed (the groups this process made). ``together`` (a job that ended well on every
        rank): a barrier first, so that no rank tears its gloo connections down while another still uses them."""
        if self.world_size == 1 and not self.owns_group:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if together and self.world_size > 1:
            dist.barrier(group=self.objects_group)
        if self.owns_group:
            dist.destroy_process_group()  # the objects group too
        elif self.objects_group is not None:
            dist.destroy_process_group(self.objects_group)


def lost_ranks_message(rank: int, world_size: int, timeout_s: float, exc: BaseException, what: str = "lost") -> str:
    """One line for a failed collective: who, the backend's first sentence (gloo's ``[file.cc:N] Connection
    closed by peer [host]:port. This is typically ...``: the part after the source location, up to the first
    full stop) and what to do."""
    detail = one_line(exc).split(": ", 1)[-1]
    detail = re.sub(r"^\[[^\]]*\]\s*", "", detail).split(". ")[0].rstrip(".") or type(exc).__name__
    return (
        f"rank {rank} of {world_size} {what} the other processes ({detail}): a process or node died, or did not "
        f"answer within --timeout {timeout_s:g} s; the finished images are kept: run the same command again on "
        "every node to complete the job"
    )


class OncePerMessage(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


@contextlib.contextmanager
def once_per_message(logger_name: str) -> Iterator[None]:
    """While inside, the logger ``logger_name`` logs each distinct message once."""
    logger = logging.getLogger(logger_name)
    once = OncePerMessage()
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --- the folder: checks, manifest, what is done ------------------------------------------------------------


def prepare_out_dir(out_dir: Path) -> Path | None:
    """Create ``out_dir`` and prove it is writable, or raise a one-line error. Returns the outermost folder it
    created (``out_dir`` or one of its parents), None when ``out_dir`` was there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FastdiffError(f"--out-dir {out_dir} exists and is not a directory")
    created = None
    for folder in (out_dir, *out_dir.parents):
        if folder.exists():
            break
        created = folder
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise FastdiffError(f"cannot write to --out-dir {out_dir}: {exc.strerror or exc}") from None
    return created


def write_probe(out_dir: Path) -> str:
    """Rank 0's empty file in ``out_dir`` that every rank must see (:func:`shared_folder_error`); its name. The name
    is a temporary one of the manifest (``TEMP_NAME``), so a rerun removes the probe of a killed job."""
    name = f".{MANIFEST}.{secrets.token_hex(6)}.probe"
    (out_dir / name).write_bytes(b"")
    return name


def shared_folder_error(config: GenerateConfig, probe: str) -> str | None:
    """None when this rank sees rank 0's ``probe`` in ``--out-dir`` (waiting up to ``SHARED_FOLDER_WAIT_S``, at
    most a quarter of ``--timeout`` so that the other ranks do not give up on this one first, for a network
    filesystem to show it), else the error: the nodes do not share the folder, and each would fill a folder of its
    own."""
    deadline = time.monotonic() + min(SHARED_FOLDER_WAIT_S, config.timeout_s / 4)
    while True:
        try:
            with open(config.out_dir / probe, "rb"):
                return None
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        except OSError:
            break
    return (
        f"--out-dir {config.out_dir} on {socket.gethostname()} is not the folder rank 0 prepared (its {probe} is "
        "not there): give every node the same --out-dir, on a filesystem that all of them share"
    )


def remove_empty_folders(out_dir: Path, created: Path | None) -> None:
    """Undo :func:`prepare_out_dir` for a job that stopped before writing anything: remove the folders it created,
    ``out_dir`` up to ``created``, while they are empty."""
    if created is None:
        return
    for folder in (out_dir, *out_dir.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): leave it
            return
        if folder == created:
            return


def hash_model_files(root: Path, suffixes: tuple[str, ...] = MODEL_FILE_SUFFIXES) -> str:
    """sha256 over the names and bytes of the config and weight files under ``root`` (the files with ``suffixes``:
    ``(".safetensors",)`` for the weights alone)."""
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
    for file in files:
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def model_hash(model: str) -> str:
    """The model's identity: a hash of its files, or the preset name for a preset without shipped weights."""
    from fastdiff.models import BUNDLED_DIR, PRESETS
    from fastdiff.models.stable_diffusion import is_random_preset, resolve_pipeline_dir

    if is_random_preset(model):  # sd15 / sd21: random weights from a fixed seed
        return f"preset:{model}:random-init-seed-0"
    path = resolve_pipeline_dir(model)  # a bundled text-to-image preset's folder, else the path as given
    if model in PRESETS and not path.exists():
        path = BUNDLED_DIR / model
        if not (path / "config.json").is_file():
            return f"preset:{model}:random-init-seed-{RANDOM_INIT_SEED}"
    return hash_model_files(path)


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FastdiffError(f"cannot read {path}: {exc}") from None
    if not isinstance(record, dict):
        raise FastdiffError(f"{path} is not a fastdiff generate manifest")
    return record


def check_manifest(existing: dict[str, Any], identity: dict[str, Any], out_dir: Path) -> None:
    """Refuse to add to a folder made with other settings (one line naming every difference)."""
    if ("prompts_sha256" in existing) != ("prompts_sha256" in identity):
        made = "with" if "prompts_sha256" in existing else "without"
        raise FastdiffError(
            f"{out_dir / MANIFEST} was made {made} --prompts: use the same settings or another --out-dir"
        )
    diffs = [
        f"{key} {existing.get(key)!r} != {identity.get(key)!r}"
        for key in (*IDENTITY_KEYS, *PROMPT_IDENTITY_KEYS)
        if existing.get(key) != identity.get(key)
    ]
    if diffs:
        raise FastdiffError(
            f"{out_dir / MANIFEST} was made with other settings ({'; '.join(diffs)}): "
            "use the same settings or another --out-dir"
        )


def existing_outputs(out_dir: Path) -> tuple[set[int], dict[str, Unit]]:
    """Seeds with a PNG in ``out_dir``, and the npz shards there by file name."""
    seeds: set[int] = set()
    shards: dict[str, Unit] = {}
    for entry in os.scandir(out_dir):
        if not entry.is_file():
            continue
        if match := PNG_NAME.fullmatch(entry.name):
            seeds.add(int(match.group(1)))
        elif match := SHARD_NAME.fullmatch(entry.name):
            shards[entry.name] = Unit(int(match.group(1)), int(match.group(2)) + 1)
    return seeds, shards


def remove_stale_temp_files(out_dir: Path) -> None:
    """Delete the temporary files of writes that a killed job never finished."""
    for entry in os.scandir(out_dir):
        if TEMP_NAME.fullmatch(entry.name):
            log.info("removing %s, left by an interrupted run", entry.name)
            Path(entry.path).unlink(missing_ok=True)


def first_number(config: GenerateConfig) -> int:
    """The number of the job's first file: ``first_seed``, or image 0 of a ``--prompts`` job."""
    return 0 if config.prompts is not None else config.first_seed


def all_units(config: GenerateConfig) -> list[Unit]:
    """The job's units, fixed by first seed (image 0 with prompts), count and batch (png) or shard size (npz),
    never by world size."""
    step = config.batch if config.image_format == "png" else config.shard_size
    first = first_number(config)
    end = first + config.num_images
    noun = "images" if config.prompts is not None else "seeds"
    return [Unit(s, min(s + step, end), noun) for s in range(first, end, step)]


def seed_ranges(seeds: set[int]) -> list[list[int]]:
    """Sorted seeds as inclusive [first, last] runs."""
    ranges: list[list[int]] = []
    for seed in sorted(seeds):
        if ranges and ranges[-1][1] == seed - 1:
            ranges[-1][1] = seed
        else:
            ranges.append([seed, seed])
    return ranges


def bytes_per_image(channels: int, height: int, width: int, image_format: str) -> int:
    """A generous size of one image on disk: raw pixels (noise does not compress) plus headers."""
    raw = channels * height * width
    if image_format == "npz":
        return raw + 64
    return 4096 * math.ceil((raw * 1.01 + height + 1024) / 4096)  # PNG filter bytes and zlib blocks; whole blocks


@dataclass
class Plan:
    """Rank 0's view of the folder before sampling: the units still to do and how many images are there."""

    pending: list[Unit]
    already_present: int


def plan_job(config: GenerateConfig, identity: dict[str, Any]) -> Plan:
    """Check the manifest and the free disk space, write the manifest, and list the units still to do."""
    out_dir = config.out_dir
    existing = read_manifest(out_dir)
    seeds, shards = existing_outputs(out_dir)
    if existing is None and (seeds or shards):
        raise FastdiffError(f"{out_dir} holds images but no {MANIFEST}: use an empty folder or a fastdiff generate one")
    if existing is not None:
        check_manifest(existing, identity, out_dir)
        remove_stale_temp_files(out_dir)
    units = all_units(config)
    if config.image_format == "png":
        first = first_number(config)
        pending = [u for u in units if not all(s in seeds for s in range(u.start, u.stop))]
        present = {s for s in seeds if first <= s < first + config.num_images}
    else:
        planned = {shard_name(u): u for u in units}
        for name, shard in shards.items():
            if name not in planned and any(u.start < shard.stop and shard.start < u.stop for u in units):
                raise FastdiffError(
                    f"{out_dir / name} overlaps this run's shards: use the --first-seed, --num-images and "
                    "--shard-size it was made with, or another --out-dir"
                )
        pending = [u for u in units if shard_name(u) not in shards]
        present = {s for u in units if shard_name(u) in shards for s in range(u.start, u.stop)}
    missing = config.num_images - len(present)
    need = missing * bytes_per_image(identity["channels"], *identity["image_size"], config.image_format)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise FastdiffError(
            f"not enough free disk in {out_dir}: {missing} images need about {need / 2**20:.0f} MiB, "
            f"{free / 2**20:.0f} MiB free"
        )
    contents = folder_contents(out_dir, prompts=config.prompts is not None)
    write_json_atomic(out_dir / MANIFEST, {**(existing or {}), **identity, **contents})
    return Plan(pending=pending, already_present=len(present))


def folder_contents(out_dir: Path, prompts: bool = False) -> dict[str, Any]:
    """The manifest's record of the seeds (with ``prompts``: the image indices) the folder holds."""
    seeds, shards = existing_outputs(out_dir)
    seeds.update(s for shard in shards.values() for s in range(shard.start, shard.stop))
    return {"num_images": len(seeds), "image_ranges" if prompts else "seed_ranges": seed_ranges(seeds)}


# --- sampling ------------------------------------------------------------------------------------------------


def load_pipeline(config: GenerateConfig, device: str):
    """The pipeline; presets without weights are initialised from a fixed seed (same model on every rank)."""
    import torch

    from fastdiff.pipelines import Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        pipe = Pipeline.from_pretrained(
            config.model, device=device, dtype=config.dtype, sampler=config.sampler, steps=config.steps,
            plan=config.plan,
        )  # fmt: skip
    if config.prompts is None and not isinstance(pipe, Pipeline):
        raise FastdiffError(f"{config.model} is a text-to-image model: give --prompts FILE (one prompt a line)")
    if config.prompts is not None and isinstance(pipe, Pipeline):
        raise FastdiffError(f"{config.model} is an unconditional model: --prompts is for text-to-image models")
    return pipe


def image_shape(pipe) -> tuple[int, int, int]:
    """(channels, height, width) of the pipeline's images (a text-to-image pipeline: at its default size)."""
    from fastdiff.pipelines import Pipeline

    if isinstance(pipe, Pipeline):
        return pipe.sample_shape
    return (pipe.vae.config.out_channels, *pipe.default_size)


def prepare_engine(pipe, batch: int, ranks: Ranks, job: PromptJob | None) -> None:
    """Build the engine's forward at ``batch`` (the first pending chunk's size) on every rank before the timed
    rounds: rank 0 first (from ``--plan``, a shipped or cached plan, or by tuning), then the others on rank 0's
    kernel plan (one plan, the same kernels, the same bytes on any number of ranks); all ranks leave together, so no
    rank's round 0 waits for another's build."""
    if ranks.world_size == 1:
        warm_up(pipe, batch, job)
        return
    from fastdiff.engine.kernel_plan import KernelPlan

    def rank0_plan() -> dict[str, Any]:
        warm_up(pipe, batch, job)
        return pipe.engine.used_plan.to_json()

    shared = ranks.on_rank0(rank0_plan)
    error = None
    if ranks.rank != 0:
        try:
            pipe.plan = KernelPlan.from_json(shared, "rank 0's kernel plan")
            warm_up(pipe, batch, job)
        except Exception as exc:
            log.exception("rank %d: building the engine failed", ranks.rank)
            error = f"building the engine failed: {one_line(exc)}"
    ranks.agree(error)


def warm_up(pipe, batch: int, job: PromptJob | None) -> None:
    """One call of ``batch`` images (seed 0, nothing kept): the engine builds that batch's forward and graphs."""
    if job is None:
        pipe(batch_size=batch, seeds=0, output_type="tensor", progress=False)
    else:
        first = job.image(0)
        pipe(
            [first.prompt] * batch, negative_prompt=first.negative_prompt, guidance_scale=first.guidance,
            seeds=0, output_type="tensor", progress=False, guidance_interval=job.guidance_interval,
        )  # fmt: skip


def sample_chunk(pipe, numbers: list[int], job: PromptJob | None) -> torch.Tensor:
    """[n, C, H, W] in [-1, 1] on the pipeline's device: the chunk's seeds, or its images of a ``--prompts`` job
    (one prompt, negative prompt, guidance scale and seed each)."""
    if job is None:
        return pipe(batch_size=len(numbers), seeds=numbers, output_type="tensor", progress=False)
    specs = job.images(numbers)
    return pipe(
        [spec.prompt for spec in specs],
        negative_prompt=[spec.negative_prompt for spec in specs],
        guidance_scale=[spec.guidance for spec in specs],
        seeds=[spec.seed for spec in specs],
        num_images_per_prompt=1,
        output_type="tensor",
        progress=False,
        guidance_interval=job.guidance_interval,
    )


def sample_unit(pipe, unit: Unit, batch: int, job: PromptJob | None = None) -> list[HostPixels]:
    """The unit's images (seeds, or images of a ``--prompts`` job), chunk by chunk, each on its way to the host
    as uint8 (``to_host``): on a GPU this returns once the work is queued."""
    return [to_host(sample_chunk(pipe, numbers, job)) for numbers in unit.chunks(batch)]


@dataclass
class HostPixels:
    """uint8 [n, H, W, C] images in host memory, complete once ``ready`` (a CUDA event; None: already) is done."""

    pixels: torch.Tensor
    ready: Any = None

    def wait(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL while it waits
        return self.pixels.numpy()


def to_host(images: torch.Tensor) -> HostPixels:
    """[n, C, H, W] in [-1, 1] -> uint8 [n, H, W, C] (``fastdiff.images.uint8_pixels``), converted where
    the images are; from a GPU copied into pinned host memory without waiting (an event marks the copy done), so
    the next chunk's sampling is queued while this one is still on its way."""
    import torch

    pixels = uint8_pixels(images).contiguous()
    if images.device.type != "cuda":
        return HostPixels(pixels)
    host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(pixels, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(images.device))
    return HostPixels(host, ready)


# --- writing -------------------------------------------------------------------------------------------------


def encode_png(pixels: np.ndarray, parameters: dict[str, Any] | None) -> bytes:
    """One uint8 [H, W, C] image as PNG bytes (grayscale for one channel, RGB for three), ``parameters`` in its
    text chunk (``fastdiff.images.png_bytes`` / ``png_info``: the fastdiff version added)."""
    return png_bytes(pil_image(pixels), parameters)


@dataclass
class Writes:
    """A unit's files being written in the background; ``wait`` returns how many new images they hold."""

    unit: Unit
    future: Future[int]

    def wait(self) -> int:
        return self.future.result()


class UnitWriter:
    """Writes each unit's files in the background, so that sampling goes on meanwhile (module docstring, "Files").

    ``start`` hands a unit to one of two unit threads, which waits for its pixels and writes them
    (``write_unit``: ``threads`` encoders encode the PNGs into temporary files, one flush to disk, the renames, one
    folder fsync). ``processes``: the encoders are processes (``forkserver``: they never touch CUDA), which keeps the
    sampling thread's GIL free; see ``writer_processes``.
    """

    def __init__(self, out_dir: Path, threads: int, processes: bool = False) -> None:
        self.out_dir = out_dir
        self.encoders: Executor
        if processes:
            import multiprocessing

            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            self.encoders = ProcessPoolExecutor(max_workers=threads, mp_context=multiprocessing.get_context(method))
        else:
            self.encoders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastdiff-png")
        self.blocks = 2 * threads
        self.units = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fastdiff-unit")

    def __enter__(self) -> UnitWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.units.shutdown(wait=True)
        self.encoders.shutdown(wait=True)

    def start(
        self,
        unit: Unit,
        chunks: list[HostPixels],
        image_format: str,
        parameters: list[dict[str, Any]] | None = None,
    ) -> Writes:
        """Write ``unit`` (its chunks' pixels; ``parameters``: one dict per PNG) in the background."""

        def write() -> int:
            import numpy as np

            pixels = np.concatenate([chunk.wait() for chunk in chunks])
            return write_unit(self.out_dir, unit, pixels, image_format, parameters, self.encoders, self.blocks)

        return Writes(unit, self.units.submit(write))


def write_unit(
    out_dir: Path,
    unit: Unit,
    pixels: np.ndarray,
    image_format: str,
    parameters: list[dict[str, Any]] | None = None,
    encoders: Executor | None = None,
    blocks: int = 1,
) -> int:
    """Write a unit's uint8 [n, H, W, C] ``pixels``: its PNGs (``parameters``: one dict per image; those already
    there, from a run killed in the middle of this unit, are left as they are) or its npz shard. The files are
    written as temporary files (PNGs encoded by ``encoders`` in blocks, else here), flushed to disk together,
    renamed onto their names, and the folder fsynced; returns how many images were written. If a file cannot be
    encoded or written, the unit's temporary files are removed and none is named (a failing rename leaves the
    files named before it: whole files)."""
    import numpy as np

    if image_format == "npz":
        seeds = np.arange(unit.start, unit.stop, dtype=np.int64)
        path = out_dir / shard_name(unit)
        written = [(write_temporary(path, npz_bytes({"images": pixels, "seeds": seeds})), path)]
        count = len(seeds)
    else:
        per_image = parameters or [None] * len(pixels)
        paths = [out_dir / png_name(number) for number in range(unit.start, unit.stop)]
        todo = [
            (path, image, own)
            for path, image, own in zip(paths, pixels, per_image, strict=True)
            if not path.is_file()  # else written by a run that was killed in the middle of this unit
        ]
        written = encode_and_write_all(todo, encoders, blocks)
        count = len(todo)
    try:
        if written:
            folder_fd = os.open(out_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                flush_to_disk(folder_fd, [tmp for tmp, _ in written])
                for tmp, path in written:
                    publish(tmp, path)
                fsync_folder(folder_fd)
            finally:
                os.close(folder_fd)
    except BaseException:
        for tmp, _ in written:  # those not renamed yet
            tmp.unlink(missing_ok=True)
        raise
    return count


def encode_and_write_all(
    todo: list[tuple[Path, np.ndarray, dict[str, Any] | None]], encoders: Executor | None, blocks: int
) -> list[tuple[Path, Path]]:
    """``encode_and_write`` of every (path, pixels, parameters), in ``blocks`` blocks on ``encoders`` (None: here);
    all or nothing: if one fails, every temporary file is removed and the first error raised."""
    if encoders is None or blocks < 2 or len(todo) < 2:
        return encode_and_write(todo)
    size = math.ceil(len(todo) / blocks)
    futures = [encoders.submit(encode_and_write, todo[k : k + size]) for k in range(0, len(todo), size)]
    wait(futures)
    written: list[tuple[Path, Path]] = []
    errors = []
    for future in futures:
        try:
            written.extend(future.result())
        except Exception as exc:  # that block removed its own temporary files
            errors.append(exc)
    if errors:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise errors[0]
    return written


def start_writes(
    pool: ThreadPoolExecutor,
    out_dir: Path,
    unit: Unit,
    images: torch.Tensor,
    image_format: str,
    parameters: dict[str, Any] | None = None,
) -> Writes:
    """Write one unit's images ([n, C, H, W] in [-1, 1]) through ``pool`` (``write_unit``, encoded in that one
    thread), each PNG recording ``parameters`` and its seed; ``run_units`` uses a ``UnitWriter`` instead."""
    per_image = None if parameters is None else [{**parameters, "seed": s} for s in range(unit.start, unit.stop)]
    pixels = to_host(images).wait()
    return Writes(unit, pool.submit(write_unit, out_dir, unit, pixels, image_format, per_image))


def encode_and_write(block: list[tuple[Path, np.ndarray, dict[str, Any] | None]]) -> list[tuple[Path, Path]]:
    """Encode each (path, pixels, parameters) as a PNG into a temporary file beside its path; (temporary, path)
    pairs. On failure the temporary files written so far are removed."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, pixels, parameters in block:
            written.append((write_temporary(path, encode_png(pixels, parameters)), path))
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    return written


def writer_processes() -> bool:
    """Whether the encoders are processes: ``FASTDIFF_WRITER=processes`` (default: threads). Steady state, a pool of
    processes encoded faster than threads (2x H200 host, 2 processes: 4,749 PNGs/s against 3,177-3,801 for 1-4
    threads; the 2-CPU development machine, 2 each: 7,651 against 5,337), but it is not the default: its workers
    (``forkserver``) re-import the caller's main module, which breaks a script without an ``if __name__ ==
    "__main__":`` guard, and ``generate`` with it has not run on a GPU yet."""
    return os.environ.get("FASTDIFF_WRITER", "").strip().lower() == "processes"


def writer_threads() -> int:
    """Encoder threads per process: the CPUs this process may use, shared with the other ranks of its host
    (``LOCAL_WORLD_SIZE``), 2 to ``WRITER_THREADS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(2, min(WRITER_THREADS, per_rank))


def run_units(config: GenerateConfig, pipe, ranks: Ranks, plan: Plan, job: PromptJob | None = None) -> list[RankStats]:
    """Sample this rank's share of ``plan.pending`` round by round: each round queues a unit's sampling and hands
    it to the writer, then waits for the previous unit's files; after each round all ranks report their counts
    (for the one progress bar) and failures (so that no rank waits for a dead one)."""
    from tqdm.auto import tqdm

    mine = plan.pending[ranks.rank :: ranks.world_size]
    rounds = math.ceil(len(plan.pending) / ranks.world_size)
    bar = tqdm(
        total=config.num_images,
        initial=plan.already_present,
        unit="img",
        desc="generate",
        disable=not config.progress or ranks.rank != 0,
    )
    written = 0
    queue_s = write_wait_s = 0.0
    start = time.perf_counter()
    with UnitWriter(config.out_dir, writer_threads(), processes=writer_processes()) as writer:
        writing: Writes | None = None
        for r in range(rounds + 1):  # the extra round waits for the last writes
            failure = None
            new = 0
            unit = mine[r] if r < len(mine) else None
            current = unit
            try:
                queued = None
                t0 = time.perf_counter()
                if unit is not None:
                    chunks = sample_unit(pipe, unit, config.batch, job)
                    parameters = unit_parameters(config, pipe, unit, job)  # now: the kernel plan of this unit
                    queued = writer.start(unit, chunks, config.image_format, parameters)
                t1 = time.perf_counter()
                if writing is not None:
                    current = writing.unit
                    new = writing.wait()
                writing = queued
                queue_s += t1 - t0
                write_wait_s += time.perf_counter() - t1
            except Exception as exc:
                log.exception("rank %d failed on %s", ranks.rank, current.label)
                failure = f"failed on {current.label}: {one_line(exc)}"
            written += new
            reports = ranks.gather((new, failure))
            bar.update(sum(count for count, _ in reports))
            failed = [(rank, message) for rank, (_, message) in enumerate(reports) if message is not None]
            if failed:
                bar.close()
                rank, message = failed[0]
                who = f"rank {rank} of {ranks.world_size} " if ranks.world_size > 1 else ""
                raise JobError(
                    f"{who}{message}; the finished images are kept: run the same command again to complete the job"
                )
    bar.close()
    seconds = time.perf_counter() - start
    return ranks.gather(RankStats(ranks.rank, device_name(pipe.device), written, seconds, queue_s, write_wait_s))


def device_name(device: torch.device) -> str:
    """``cuda:1 (NVIDIA H100 80GB HBM3)`` or ``cpu``."""
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def generate(config: GenerateConfig) -> GenerateSummary:
    """Generate the configured seeds into ``config.out_dir`` (see the module docstring); every rank gets the
    summary of the whole job."""
    job = validate(config)
    if job is not None:
        config = replace(config, num_images=job.num_images)
    ranks = Ranks.start(config.device, config.timeout_s)
    try:
        summary = generate_on(config, ranks, job)
    except BaseException:
        ranks.close()
        raise
    ranks.close(together=True)
    return summary


def validate(config: GenerateConfig) -> PromptJob | None:
    """Every setting, the prompts file (the job it makes, returned) and that files can be created in ``out_dir``:
    one-line errors before any work."""
    from fastdiff.pipelines.text_to_image import is_text_to_image_dir

    text_model = is_text_to_image_dir(config.model)
    if text_model and config.prompts is None:
        raise FastdiffError(f"{config.model} is a text-to-image model: give --prompts FILE (one prompt a line)")
    if not text_model and config.prompts is not None:
        raise FastdiffError(f"{config.model} is an unconditional model: --prompts is for text-to-image models")
    if config.num_images is None and config.prompts is None:
        raise FastdiffError("give --num-images N (or --prompts FILE for a text-to-image model)")
    if config.num_images is not None and config.num_images <= 0:
        raise FastdiffError(f"--num-images must be positive, got {config.num_images}")
    if config.prompts is not None and config.image_format != "png":
        raise FastdiffError("--prompts jobs write PNGs only: drop --format npz")
    guidance = config.guidance
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance):
        raise FastdiffError(f"--guidance must be a finite number >= 0, got {guidance!r}")
    if guidance < 0:
        raise FastdiffError(f"--guidance must be a finite number >= 0, got {guidance!r}")
    if tuple(config.guidance_interval) != FULL_GUIDANCE and config.prompts is None:
        raise FastdiffError("--guidance-interval needs --prompts")
    check_guidance_interval(config.guidance_interval, "--guidance-interval")
    job = load_prompt_job(config)
    num_images = job.num_images if job is not None else config.num_images
    last = config.first_seed + num_images - 1
    if config.first_seed < 0 or last > MAX_SEED:
        raise FastdiffError(f"seeds must be in 0..{MAX_SEED}, got --first-seed {config.first_seed} to {last}")
    if not (isinstance(config.timeout_s, (int, float)) and 0 < config.timeout_s < float("inf")):
        raise FastdiffError(f"--timeout must be a positive number of seconds, got {config.timeout_s}")
    if config.batch <= 0 or config.shard_size <= 0 or config.steps <= 0:
        raise FastdiffError("--batch, --shard-size and --steps must be positive")
    if config.image_format not in FORMATS:
        raise FastdiffError(f"unknown format {config.image_format!r}: use one of {', '.join(FORMATS)}")
    if config.sampler not in SAMPLERS:
        raise FastdiffError(f"unknown sampler {config.sampler!r}: use one of {', '.join(SAMPLERS)}")
    if config.dtype not in DTYPES:
        raise FastdiffError(f"unknown dtype {config.dtype!r}: use one of {', '.join(DTYPES)}")
    check_output_location(config.out_dir, "--out-dir", folder=True)
    return job


def generate_on(config: GenerateConfig, ranks: Ranks, job: PromptJob | None = None) -> GenerateSummary:
    setup_start = time.perf_counter()
    created = ranks.on_rank0(lambda: prepare_out_dir(config.out_dir))
    probe = ranks.on_rank0(lambda: write_probe(config.out_dir)) if ranks.world_size > 1 else None
    pipe, error = None, None
    try:
        pipe = load_pipeline(config, ranks.device)
    except FastdiffError as exc:
        error = str(exc)
    except Exception as exc:
        log.exception("loading %s failed", config.model)
        error = f"loading {config.model} failed: {one_line(exc)}"
    if error is None and probe is not None:
        error = shared_folder_error(config, probe)
    try:
        ranks.agree(error)
    except JobError:  # nothing was written: leave no folder behind either
        if probe is not None and ranks.rank == 0:
            (config.out_dir / probe).unlink(missing_ok=True)
        ranks.on_rank0(lambda: remove_empty_folders(config.out_dir, created))
        raise
    if probe is not None and ranks.rank == 0:
        (config.out_dir / probe).unlink(missing_ok=True)
    plan = ranks.on_rank0(lambda: plan_job(config, job_identity(config, image_shape(pipe), job)))
    if pipe.backend == "engine" and plan.pending:  # the engine's forward is built here, not in the timed rounds
        first = plan.pending[0]
        prepare_engine(pipe, min(config.batch, first.stop - first.start), ranks, job)
    setup_seconds = time.perf_counter() - setup_start
    if ranks.rank == 0:
        log.info(
            "%d of %d images already in %s; %d %s to sample on %d rank(s)",
            plan.already_present,
            config.num_images,
            config.out_dir,
            len(plan.pending),
            "chunks" if config.image_format == "png" else "shards",
            ranks.world_size,
        )
    with once_per_message(PROMPT_WARNINGS_LOGGER):  # a bad word of a prompt: one warning, not one per chunk
        per_rank = run_units(config, pipe, ranks, plan, job)
    summary = GenerateSummary(
        out_dir=str(config.out_dir),
        rank=ranks.rank,
        num_images=config.num_images,
        written=sum(stats.images for stats in per_rank),
        already_present=plan.already_present,
        world_size=ranks.world_size,
        setup_seconds=setup_seconds,
        seconds=max(stats.seconds for stats in per_rank),
        ranks=per_rank,
    )
    if ranks.rank == 0:
        manifest = read_manifest(config.out_dir) or {}
        plan_digest = {"kernel_plan": pipe.plan_digest} if pipe.plan_digest else {}
        contents = folder_contents(config.out_dir, prompts=job is not None)
        write_json_atomic(config.out_dir / MANIFEST, {**manifest, **contents, **plan_digest})
        write_json_atomic(config.out_dir / SUMMARY, {**summary.to_json(), **run_settings(config)})
    return summary


def job_identity(
    config: GenerateConfig, sample_shape: tuple[int, int, int], job: PromptJob | None = None
) -> dict[str, Any]:
    """The manifest's record of what makes the images (``IDENTITY_KEYS``, with prompts ``PROMPT_IDENTITY_KEYS``
    too) plus the model as given and the prompts as read."""
    import torch

    channels, height, width = sample_shape
    prompts = {}
    if job is not None:
        prompts = {
            "prompts_file": str(job.path),
            "prompts_sha256": job.sha256,
            "first_seed": config.first_seed,
            "guidance": config.guidance,
            "negative_prompt": config.negative_prompt,
            **interval_record(config.guidance_interval),
            "prompts": job.manifest_record(),
        }
    return {
        "model": config.model,
        "model_hash": model_hash(config.model),
        "sampler": config.sampler,
        "steps": config.steps,
        "dtype": config.dtype,
        "image_size": [height, width],
        "channels": channels,
        "format": config.image_format,
        "shard_size": config.shard_size if config.image_format == "npz" else None,
        "fastdiff_version": fastdiff.__version__,
        "torch_version": torch.__version__,
        **prompts,
    }


def interval_record(interval: tuple[float, float]) -> dict[str, list[float]]:
    """``{"guidance_interval": [start, stop]}`` for the manifest and the PNGs, or nothing for every step guided."""
    return {} if tuple(interval) == FULL_GUIDANCE else {"guidance_interval": list(interval)}


def image_parameters(config: GenerateConfig) -> dict[str, Any]:
    """What each PNG records besides its seed (the same on every rank, so the bytes do not depend on the process
    count)."""
    return {"model": config.model, "sampler": config.sampler, "steps": config.steps, "dtype": config.dtype}


def unit_parameters(config: GenerateConfig, pipe, unit: Unit, job: PromptJob | None) -> list[dict[str, Any]]:
    """What each PNG of ``unit`` records (``fastdiff.images.png_info`` adds the fastdiff version): its seed and
    ``image_parameters``; with prompts also its prompt, negative prompt, guidance and size. Call it right after
    the unit is sampled: the kernel plan digest is the last call's."""
    common = image_parameters(config)
    if pipe.plan_digest is not None:
        common["kernel_plan"] = pipe.plan_digest
    numbers = range(unit.start, unit.stop)
    if job is None:
        return [{**common, "seed": seed} for seed in numbers]
    _, height, width = image_shape(pipe)
    return [
        {
            "prompt": spec.prompt,
            "negative_prompt": spec.negative_prompt,
            "guidance": spec.guidance,
            **interval_record(job.guidance_interval),
            "seed": spec.seed,
            **common,
            "height": height,
            "width": width,
        }
        for spec in job.images(list(numbers))
    ]


def run_settings(config: GenerateConfig) -> dict[str, Any]:
    """The settings of this run that the manifest does not pin (they may change between reruns)."""
    return {
        "model": config.model,
        "first_seed": config.first_seed,
        "batch": config.batch,
        "device": config.device,
    }


# --- command line --------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand (sets ``func=run_generate``)."""
    from fastdiff.cli_args import add_command

    add_command(subparsers, "generate", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff generate`` (sets ``func=run_generate``)."""
    from fastdiff.cli_args import (
        add_plan_argument,
        finite_nonnegative_float,
        positive_float,
        positive_int,
        seed_int,
    )

    defaults = GenerateConfig(model="", num_images=1, out_dir=Path())
    p.description = (
        "Generate seeds FIRST_SEED .. FIRST_SEED+N-1 into OUT_DIR as SEED.png files (or .npz shards "
        "of a fixed seed range); for a text-to-image model, the images of a --prompts FILE as INDEX.png "
        "(000000.png, ...: by image index, as seeds may repeat). Run alone or as "
        "'torchrun --nproc-per-node G -m fastdiff.cli generate ...': "
        "the files are byte-identical whatever the number of processes. Rerunning the same command skips the "
        "images already written; OUT_DIR/manifest.json must match the settings. Rank 0 writes summary.json."
    )
    p.add_argument(
        "--model",
        required=True,
        help="preset name or a local diffusers/fastdiff model directory; a text-to-image model (fashion-mnist-t2i, "
        "a StableDiffusionPipeline directory) needs --prompts",
    )
    p.add_argument(
        "--num-images",
        type=positive_int,
        default=None,
        help="number of images (seeds); required without --prompts; with --prompts: the first N of the images the "
        "file lists, the list repeated as often as needed (default: the file's images, once)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help="text-to-image prompts: one a line (blank lines skipped), or JSONL (first non-blank line starts with "
        '{): {"prompt": "...", "negative_prompt": "...", "seed": S, "guidance": G, "n": K} a line, all but prompt '
        "optional; image i gets seed FIRST_SEED+i, or S, S+1, ... on a line with seed; PNGs named by image index",
    )
    p.add_argument(
        "--guidance",
        type=finite_nonnegative_float,
        default=defaults.guidance,
        help="classifier-free guidance scale of the --prompts lines that give none; <= 1: unguided (a job is all "
        "guided or all unguided)",
    )
    p.add_argument(
        "--negative-prompt",
        default=None,
        help="negative prompt of the --prompts lines without one (default: none)",
    )
    p.add_argument(
        "--guidance-interval",
        nargs=2,
        type=float,
        metavar=("START", "STOP"),
        default=defaults.guidance_interval,
        help="guide only steps int(START x STEPS) .. int(STOP x STEPS) - 1 of every image (diffusers' "
        "ClassifierFreeGuidance start/stop; default 0 1: every step)",
    )
    p.add_argument("--out-dir", type=Path, required=True, help="output folder (created; shared by all nodes)")
    p.add_argument("--first-seed", type=seed_int, default=defaults.first_seed, help="seed of the first image (image 0)")
    p.add_argument("--sampler", default=defaults.sampler, choices=SAMPLERS, help="sampling algorithm")
    p.add_argument("--steps", type=positive_int, default=defaults.steps, help="number of denoising steps")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=DTYPE_HELP,
    )
    p.add_argument(
        "--device", default=defaults.device, help="auto, cpu, cuda or cuda:N (under torchrun: cuda:LOCAL_RANK)"
    )
    p.add_argument("--batch", type=positive_int, default=defaults.batch, help="images per batch on each process")
    p.add_argument("--format", dest="image_format", default=defaults.image_format, choices=FORMATS, help="file type")
    p.add_argument("--shard-size", type=positive_int, default=defaults.shard_size, help="seeds per .npz shard")
    p.add_argument(
        "--timeout", type=positive_float, default=defaults.timeout_s, help="seconds a process waits for the others"
    )
    add_plan_argument(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    config = GenerateConfig(
        model=args.model,
        num_images=args.num_images,
        out_dir=args.out_dir,
        first_seed=args.first_seed,
        sampler=args.sampler,
        steps=args.steps,
        dtype=resolve_dtype_choice(args.dtype, args.device),
        device=args.device,
        batch=args.batch,
        image_format=args.image_format,
        shard_size=args.shard_size,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        plan=args.plan,
        prompts=args.prompts,
        guidance=args.guidance,
        negative_prompt=args.negative_prompt or "",
        guidance_interval=tuple(args.guidance_interval),
    )
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank != 0:  # one voice for the job: rank 0 logs, the others only warn
        logging.getLogger("fastdiff").setLevel(max(logging.WARNING, logging.getLogger("fastdiff").getEffectiveLevel()))
    try:
        summary = generate(config)
    except LostRanks:
        if local_rank != 0:  # the first process of each node reports it (rank 0 may be gone)
            return 2
        raise
    except JobError:
        if rank != 0:  # rank 0 prints the same line
            return 2
        raise
    if rank == 0:
        log.info(
            "%s: %d new images (%d were there) in %.1f s, %.1f images/s on %d process(es)",
            summary.out_dir,
            summary.written,
            summary.already_present,
            summary.seconds,
            summary.images_per_s,
            summary.world_size,
        )
    return 0
