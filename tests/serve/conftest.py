"""Fixtures of the serve tests: a uvicorn server in a thread on a free port, fast stand-in pipelines (unconditional
and text-to-image) and the bundled fashion-mnist-t2i served on the CPU."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from fastdiff.errors import FastdiffError

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

FAIL_SEED = 666
"""A batch holding this seed raises in ``FakePipeline`` (a sampling failure)."""


@contextmanager
def live_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class FakePipeline:
    """The public surface of ``fastdiff.pipelines.unconditional.Pipeline`` the server uses, without a model.

    Image k is a flat gray of ``seeds[k] % 256``. Every call is recorded in ``calls`` and waits for ``gate``
    (set by default), so a test can hold the worker inside a batch.
    """

    sample_shape = (1, 8, 8)
    device = torch.device("cpu")
    unet = None

    def __init__(self, sampler: str, steps: int, gate: threading.Event, calls: list, delay_s: float) -> None:
        self.sampler = sampler
        self.steps = steps
        self.gate = gate
        self.calls = calls
        self.delay_s = delay_s
        self.entered = threading.Event()

    def __call__(self, batch_size: int, seeds: list[int], output_type: str = "pil", progress: bool = True):
        assert len(seeds) == batch_size and output_type == "pil" and not progress
        self.calls.append((self.sampler, self.steps, list(seeds)))
        self.entered.set()
        assert self.gate.wait(60), "test gate never opened"
        time.sleep(self.delay_s)
        if FAIL_SEED in seeds:
            raise RuntimeError("simulated sampling failure")
        return [Image.new("L", (8, 8), seed % 256) for seed in seeds]


class FakeFactory:
    """``pipeline_factory(sampler, steps)`` making ``FakePipeline``s that share one gate and one call log."""

    fail_seed = FAIL_SEED
    max_steps = 500

    def __init__(self, delay_s: float = 0.0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[tuple[str, int, list[int]]] = []
        self.pipelines: list[FakePipeline] = []
        self.delay_s = delay_s

    def __call__(self, sampler: str, steps: int) -> FakePipeline:
        if steps > self.max_steps:
            raise FastdiffError(f"steps must be in 1..{self.max_steps}, got {steps}")
        pipe = FakePipeline(sampler, steps, self.gate, self.calls, self.delay_s)
        self.pipelines.append(pipe)
        return pipe


class FakeTextPipeline:
    """The surface of ``TextToImagePipeline`` the server uses, without a model: 32x32 default, sizes in multiples of
    16 (vae_scale 4, three U-Net levels), no tokenizer (no prompt warnings). Image k is a flat gray of
    ``seeds[k] % 256`` at the asked size; every call's keyword arguments are recorded in ``calls``."""

    device = torch.device("cpu")
    default_size = (32, 32)
    vae_scale = 4
    unet = SimpleNamespace(config=SimpleNamespace(block_out_channels=(8, 16, 16)))
    vae = SimpleNamespace(config=SimpleNamespace(in_channels=3, out_channels=3))
    components = SimpleNamespace(tokenizer=None)

    def __init__(self, calls: list, gate: threading.Event) -> None:
        self.calls = calls
        self.gate = gate
        self.cleared = 0

    def clear_prepared(self) -> None:
        self.cleared += 1

    def __call__(self, prompt: list[str], **kwargs):
        assert kwargs["num_images_per_prompt"] == 1 and not kwargs["progress"]
        self.calls.append({"prompt": list(prompt), **kwargs})
        assert self.gate.wait(60), "test gate never opened"
        height, width = kwargs["height"], kwargs["width"]
        return [Image.new("L", (width, height), seed % 256) for seed in kwargs["seeds"]]


class FakeTextFactory:
    """``pipeline_factory(sampler, steps)`` making ``FakeTextPipeline``s; ``loads`` counts them, ``made`` holds them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.gate = threading.Event()
        self.gate.set()
        self.loads = 0
        self.made: list[FakeTextPipeline] = []

    def __call__(self, sampler: str, steps: int) -> FakeTextPipeline:
        self.loads += 1
        self.made.append(FakeTextPipeline(self.calls, self.gate))
        return self.made[-1]


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def serve_app():
    """``serve_app(app)``: a context manager serving ``app`` on a free local port; yields its base URL."""
    return live_server


@pytest.fixture
def fake_factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
def fake_text_factory() -> FakeTextFactory:
    return FakeTextFactory()


@pytest.fixture(scope="session")
def t2i_app():
    """The bundled fashion-mnist-t2i on the CPU, loaded once: 2 steps, guidance 3, batches of 4 (one run size),
    a generous wait even when idle, so that concurrent requests meet. Tests may serve it one after another."""
    pytest.importorskip("transformers")
    from fastdiff.serve.app import create_app

    return create_app(
        "fashion-mnist-t2i",
        device="cpu",
        steps=2,
        guidance=3.0,
        max_batch=4,
        max_wait_ms=300,
        queue_size=16,
        idle_start=False,
    )


@pytest.fixture
def waiter():
    """``waiter(condition, what)``: poll until ``condition()`` is true (AssertionError after 30 s)."""
    return wait_until
