"""``fastdiff generate``'s writer (CPU): uint8 conversion as ``fastdiff.images.to_uint8`` does it, a unit's PNGs
flushed to disk before any of them gets its name, a failing unit publishing nothing, threads per rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import fastdiff.atomic as atomic
import fastdiff.generate as generate_module
from fastdiff.generate import HostPixels, Unit, UnitWriter, to_host, writer_threads
from fastdiff.images import to_uint8


def test_to_host_rounds_as_to_uint8():
    images = torch.linspace(-1.2, 1.2, 2 * 3 * 5 * 7).reshape(2, 3, 5, 7)
    host = to_host(images)
    assert host.ready is None
    np.testing.assert_array_equal(host.wait(), to_uint8(images))


def unit_pixels(unit: Unit, channels: int = 3) -> HostPixels:
    count = unit.stop - unit.start
    pixels = torch.arange(count * 4 * 4 * channels, dtype=torch.int64).reshape(count, 4, 4, channels) % 256
    return HostPixels(pixels.to(torch.uint8))


def test_a_units_files_get_their_names_only_after_they_are_flushed(tmp_path, monkeypatch):
    events = []
    flush, publish = generate_module.flush_to_disk, generate_module.publish

    def flush_and_note(folder_fd, files):
        assert [p.name for p in tmp_path.glob("0*.png")] == ["000011.png"]  # none of the new files named yet
        events.append(("flush", sorted(f.name.split(".")[1] for f in files)))
        flush(folder_fd, files)

    def publish_and_note(tmp, path):
        events.append(("publish", path.stem))
        publish(tmp, path)

    monkeypatch.setattr(generate_module, "flush_to_disk", flush_and_note)
    monkeypatch.setattr(generate_module, "publish", publish_and_note)
    unit = Unit(10, 14)
    (tmp_path / "000011.png").write_bytes(b"kept")  # written by an earlier, killed run: left as it is
    parameters = [{"seed": seed} for seed in range(10, 14)]
    with UnitWriter(tmp_path, threads=2) as writer:
        assert writer.start(unit, [unit_pixels(unit)], "png", parameters).wait() == 3
    assert events[0] == ("flush", ["000010", "000012", "000013"])
    assert sorted(events[1:]) == [("publish", "000010"), ("publish", "000012"), ("publish", "000013")]
    assert (tmp_path / "000011.png").read_bytes() == b"kept"
    with Image.open(tmp_path / "000012.png") as image:
        assert image.mode == "RGB" and json.loads(image.text["parameters"])["seed"] == 12
        np.testing.assert_array_equal(np.asarray(image), unit_pixels(unit).wait()[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"0000{k}.png" for k in range(10, 14)]


def test_a_unit_that_fails_to_write_publishes_nothing(tmp_path, monkeypatch):
    write = generate_module.write_temporary

    def write_but_one(path, data):
        if path.name == "000002.png":
            raise OSError(28, "No space left on device")
        return write(path, data)

    monkeypatch.setattr(generate_module, "write_temporary", write_but_one)
    unit = Unit(0, 6)
    with UnitWriter(tmp_path, threads=2) as writer, pytest.raises(OSError, match="No space left"):
        writer.start(unit, [unit_pixels(unit, channels=1)], "png").wait()
    assert list(tmp_path.iterdir()) == []


def test_without_syncfs_each_file_is_fsynced(tmp_path, monkeypatch):
    synced = []
    fsync = atomic.os.fsync
    monkeypatch.setattr(atomic, "SYNCFS", None)
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    unit = Unit(0, 3)
    with UnitWriter(tmp_path, threads=1) as writer:
        assert writer.start(unit, [unit_pixels(unit)], "png").wait() == 3
    assert len(synced) == 3 + 1  # each file, then the folder


@pytest.mark.parametrize(("local_world_size", "expected"), [("1", 8), ("2", 8), ("4", 4), ("64", 2)])
def test_writer_threads_share_the_cpus_among_the_ranks_of_a_host(monkeypatch, local_world_size, expected):
    monkeypatch.setattr(generate_module.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert writer_threads() == expected


def test_each_round_queues_the_next_unit_before_it_waits_for_the_last_ones_files(tmp_path, monkeypatch):
    events = []

    class NotedResult:
        def __init__(self, unit):
            self.unit = unit

        def result(self):
            events.append(("wait", self.unit.start))
            return self.unit.stop - self.unit.start

    def sample(pipe, unit, batch, job=None):
        events.append(("sample", unit.start))
        return [unit_pixels(unit)]

    def start(writer, unit, chunks, image_format, parameters=None):
        events.append(("start", unit.start))
        return generate_module.Writes(unit, NotedResult(unit))

    monkeypatch.setattr(generate_module, "sample_unit", sample)
    monkeypatch.setattr(generate_module.UnitWriter, "start", start)
    config = generate_module.GenerateConfig("m", 6, tmp_path, batch=2, progress=False)
    plan = generate_module.Plan(pending=generate_module.all_units(config), already_present=0)
    pipe = type("FakePipe", (), {"device": torch.device("cpu"), "plan_digest": None})()
    ranks = generate_module.Ranks(0, 1, "cpu", owns_group=False)
    (stats,) = generate_module.run_units(config, pipe, ranks, plan)
    assert stats.images == 6
    assert events == [
        ("sample", 0), ("start", 0),
        ("sample", 2), ("start", 2), ("wait", 0),  # unit 2 is on its way before unit 0's files are awaited
        ("sample", 4), ("start", 4), ("wait", 2),
        ("wait", 4),
    ]  # fmt: skip


def test_process_encoders_write_the_same_bytes_as_threads(tmp_path, monkeypatch):
    """``UnitWriter(processes=True)``: the PNGs are encoded in a process pool, byte for byte the thread pool's;
    ``writer_processes`` follows FASTDIFF_WRITER (default: threads)."""
    from fastdiff.generate import writer_processes

    unit = Unit(0, 6)
    parameters = [{"seed": seed, "prompt": "bag"} for seed in range(6)]
    for mode in ("threads", "processes"):
        (tmp_path / mode).mkdir()
        with UnitWriter(tmp_path / mode, threads=2, processes=mode == "processes") as writer:
            assert writer.start(unit, [unit_pixels(unit, channels=1)], "png", parameters).wait() == 6
    for k in range(6):
        name = f"{k:06d}.png"
        assert (tmp_path / "threads" / name).read_bytes() == (tmp_path / "processes" / name).read_bytes()
    monkeypatch.setenv("FASTDIFF_WRITER", "processes")
    assert writer_processes()
    for value in ("threads", ""):
        monkeypatch.setenv("FASTDIFF_WRITER", value)
        assert not writer_processes()


def test_engine_is_built_before_the_timed_rounds(tmp_path):
    """``prepare_engine`` (one process): one call at the first chunk's size, seed 0, nothing kept, so the engine's
    build (plan or tuning, first forward, graph capture) counts as setup, not as sampling time."""
    calls = []

    class FakePipe:
        backend = "engine"

        def __call__(self, **kwargs):
            calls.append(kwargs)

    generate_module.prepare_engine(FakePipe(), 256, generate_module.Ranks(0, 1, "cpu", owns_group=False), None)
    assert calls == [{"batch_size": 256, "seeds": 0, "output_type": "tensor", "progress": False}]
