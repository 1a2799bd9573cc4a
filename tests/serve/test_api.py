"""fastdiff serve over HTTP: batching keeps images byte-identical, bad requests get 422, a full queue 429, a client
that leaves is dropped without sampling, failures give 500, and the server stays healthy with parseable metrics."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402  (after the importorskip)

from fastdiff.cli import main  # noqa: E402
from fastdiff.errors import FastdiffError  # noqa: E402
from fastdiff.serve.app import MAX_BODY_BYTES, create_app  # noqa: E402
from fastdiff.serve.loadtest import run_loadtest  # noqa: E402

SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; fails on any line that is not a comment or a sample."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SAMPLE_LINE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        samples[match[1] + (match[2] or "")] = float(match[3])
    return samples


def decode(response_json: dict) -> list[bytes]:
    return [base64.b64decode(image["png_base64"]) for image in response_json["images"]]


@pytest.fixture(scope="module")
def fmnist_app():
    """The bundled fashion-mnist model on CPU, 2 steps, batches of 4, a generous wait even when idle, so that
    concurrent requests meet."""
    return create_app(
        "fashion-mnist", device="cpu", steps=2, max_batch=4, max_wait_ms=400, queue_size=16, idle_start=False
    )


BAD_REQUESTS = [
    ("", 'the request is empty: send a JSON object such as {"n": 2}'),
    ("{}", "the request is empty"),
    ("{not json", "Invalid JSON"),
    ('{"n": 1000000}', "n=1000000 is more than this server's limit of 4"),
    ('{"steps": 0}', "steps: Input should be greater than or equal to 1"),
    ('{"steps": 5000}', "steps: Input should be less than or equal to 1000"),
    ('{"sampler": "heun9"}', "unknown sampler 'heun9'"),
    ('{"size": 64}', "size 64x64 is not available"),
    ('{"size": [32, 31]}', "size 32x31 is not available"),
    ('{"n": 2.5}', "n: Input should be a valid integer"),
    ('{"seed": -1}', "seed: Input should be greater than or equal to 0"),
    ('{"seed": 1, "seeds": [2]}', "either seed or seeds"),
    ('{"n": 3, "seeds": [1, 2]}', "n=3 but 2 seeds"),
    ('{"prompt": "a red dress"}', "unconditional: it takes no 'prompt'"),
    ('{"negative_prompt": "blurry"}', "unconditional: it takes no 'negative_prompt'"),
    ('{"guidance": 7.5}', "unconditional: it takes no 'guidance'"),
    ('{"prompts": ["a", "b"]}', "unconditional: it takes no 'prompts'"),
    ('{"width": 32}', "unconditional: it takes no 'width'"),
    ('{"init_image": "iVBORw0KGgo="}', "unconditional: it takes no 'init_image'"),
    ('{"guidance": NaN}', "guidance: Input should be a finite number"),
    ('{"steps": 2, "colour": "red"}', "colour: Extra inputs are not permitted"),
    ("[1, 2]", "Input should be an object"),
]


def test_bad_requests_get_422_and_never_reach_the_model(fmnist_app):
    with TestClient(fmnist_app) as client:
        for body, message in BAD_REQUESTS:
            response = client.post("/v1/images", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 422, body
            error = response.json()["error"]
            assert message in error and "\n" not in error, (body, error)
        too_long = b" " * (MAX_BODY_BYTES + 1)
        huge = client.post("/v1/images", content=too_long, headers={"content-type": "application/json"})
        assert huge.status_code == 413 and "request body is over" in huge.json()["error"]
        response = client.post("/v1/images", json={"n": 2}, headers={"accept": "image/png"})
        assert response.status_code == 406 and "n = 1" in response.json()["error"]
        metrics = parse_metrics(client.get("/metrics").text)
        assert metrics['fastdiff_requests_total{code="422"}'] == len(BAD_REQUESTS)
        assert metrics["fastdiff_batch_size_count"] == 0  # nothing was sampled
        assert client.get("/health").json()["status"] == "ok"


def test_model_info_and_page(fmnist_app):
    with TestClient(fmnist_app) as client:
        info = client.get("/v1/model").json()
        page = client.get("/")
    assert info["conditional"] is False and (info["channels"], info["height"], info["width"]) == (1, 32, 32)
    assert info["default_steps"] == 2 and info["max_images_per_request"] == 4 and "ddim" in info["samplers"]
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="generate"' in page.text


@pytest.mark.slow
def test_batched_images_are_byte_identical_to_solo(fmnist_app, serve_app):
    requests = [{"seeds": [10, 11]}, {"seed": 20}, {"seed": 30}]
    with serve_app(fmnist_app) as url, httpx.Client(base_url=url, timeout=120) as client:
        solo = [client.post("/v1/images", json=body).json() for body in requests]
        png = client.post("/v1/images", json={"seed": 20}, headers={"accept": "image/png"})
        barrier = threading.Barrier(len(requests))

        def send(body: dict) -> dict:
            barrier.wait()
            with httpx.Client(base_url=url, timeout=120) as own:
                response = own.post("/v1/images", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(len(requests)) as pool:
            batched = list(pool.map(send, requests))
        metrics = parse_metrics(client.get("/metrics").text)
    for alone, together, body in zip(solo, batched, requests, strict=True):
        assert [image["seed"] for image in together["images"]] == together["parameters"]["seeds"]
        assert len(together["images"]) == len(body.get("seeds", [0]))
        assert alone["timing"]["batch_images"] == len(alone["images"])
        assert decode(together) == decode(alone)
    assert max(r["timing"]["batch_images"] for r in batched) > 2, "the concurrent requests never shared a batch"
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.headers["x-fastdiff-seed"] == "20" and png.content == decode(solo[1])[0]
    pixels = [np.asarray(Image.open(io.BytesIO(png))) for png in decode(solo[0]) + decode(solo[2])]
    assert pixels[0].shape == (32, 32) and not np.array_equal(pixels[0], pixels[1])
    assert not np.array_equal(pixels[0], pixels[2])
    assert metrics["fastdiff_images_total"] == 2 * 4 + 1
    assert metrics['fastdiff_requests_total{code="200"}'] == 2 * 3 + 1


def test_incompatible_requests_do_not_share_a_batch(fake_factory, serve_app):
    app = create_app("fake", pipeline_factory=fake_factory, steps=5, max_batch=8, max_wait_ms=500, idle_start=False)
    bodies = [{"seed": 1}, {"seed": 2, "steps": 7}, {"seed": 3, "sampler": "ddpm"}, {"seed": 4}]
    with serve_app(app) as url, ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: httpx.post(f"{url}/v1/images", json=body, timeout=30), bodies))
    assert all(r.status_code == 200 for r in responses)
    batches = {(sampler, steps): seeds for sampler, steps, seeds in fake_factory.calls}
    assert len(fake_factory.calls) == 3
    assert all(len(seeds) == 8 for _, _, seeds in fake_factory.calls)  # every batch padded to the one run size
    assert sorted(batches[("ddim", 5)][:2]) == [1, 4] and batches[("ddim", 7)][0] == 2
    assert batches[("ddpm", 5)][0] == 3
    for body, response in zip(bodies, responses, strict=True):
        image = Image.open(io.BytesIO(decode(response.json())[0]))
        assert image.getpixel((0, 0)) == body["seed"]


@pytest.mark.slow
def test_full_queue_429_disconnect_dropped_failure_500_then_healthy(fake_factory, serve_app, waiter):
    app = create_app("fake", pipeline_factory=fake_factory, max_batch=1, max_wait_ms=0, queue_size=2)
    batcher = app.state.batcher
    fake_factory.gate.clear()
    with serve_app(app) as url, ThreadPoolExecutor(4) as pool:
        running = pool.submit(httpx.post, f"{url}/v1/images", json={"seed": 1}, timeout=60)
        waiter(lambda: fake_factory.calls, "the first batch to start")
        leaving = pool.submit(httpx.post, f"{url}/v1/images", json={"seed": 2}, timeout=2.0)
        waiter(lambda: batcher.depth()[0] == 1, "the second request to queue")
        queued = pool.submit(httpx.post, f"{url}/v1/images", json={"seed": 3}, timeout=60)
        waiter(lambda: batcher.depth()[0] == 2, "the third request to queue")
        rejected = httpx.post(f"{url}/v1/images", json={"seed": 4}, timeout=10)
        assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
        assert "queue is full" in rejected.json()["error"]
        with pytest.raises(httpx.TimeoutException):
            leaving.result()
        waiter(lambda: batcher.depth()[0] == 1, "the server to drop the request whose client left")
        fake_factory.gate.set()
        assert running.result().status_code == 200 and queued.result().status_code == 200
        assert [seeds for _, _, seeds in fake_factory.calls] == [[1], [3]]  # seed 2 never sampled

        failed = httpx.post(f"{url}/v1/images", json={"seed": fake_factory.fail_seed}, timeout=10)
        assert failed.status_code == 500 and "simulated sampling failure" in failed.json()["error"]
        assert httpx.post(f"{url}/v1/images", json={"seed": 5}, timeout=10).status_code == 200
        too_many_steps = httpx.post(f"{url}/v1/images", json={"steps": 999}, timeout=10)  # the pipeline refuses
        assert too_many_steps.status_code == 422 and "steps must be in 1..500" in too_many_steps.json()["error"]

        health = httpx.get(f"{url}/health", timeout=10)
        metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert metrics["fastdiff_requests_dropped_total"] == 1
    assert metrics['fastdiff_requests_total{code="429"}'] == 1
    assert metrics['fastdiff_requests_total{code="500"}'] == 1
    assert metrics['fastdiff_requests_total{code="200"}'] == 3
    assert metrics["fastdiff_queue_depth"] == 0
    assert metrics['fastdiff_batch_size_bucket{le="+Inf"}'] == metrics["fastdiff_batch_size_count"] == 3
    p50, p99 = (
        metrics['fastdiff_request_latency_seconds{quantile="0.5"}'],
        metrics['fastdiff_request_latency_seconds{quantile="0.99"}'],
    )
    assert 0 < p50 <= p99 and math.isfinite(p99)


def test_loadtest_under_overload_sheds_with_429_and_answers_the_rest(fake_factory, serve_app, tmp_path):
    fake_factory.delay_s = 0.05
    app = create_app("fake", pipeline_factory=fake_factory, max_batch=2, max_wait_ms=5, queue_size=2)
    out = tmp_path / "load.json"
    with serve_app(app) as url:
        normal = run_loadtest(url, concurrency=2, requests=10, n=1)
        with pytest.raises(FastdiffError, match="runs an unconditional model: it takes no prompts"):
            run_loadtest(url, concurrency=1, requests=1, prompts=["a red dress"])
        overload_args = ["--concurrency", "12", "--requests", "60", "--seed", "1000", "--out", str(out)]
        exit_code = main(["loadtest", "--url", url, *overload_args])
    assert normal["ok"] == 10 and normal["rejected_429"] == 0 and normal["errors"] == 0
    assert normal["images"] == 10 and normal["images_per_s"] > 0 and normal["healthy_after"]
    assert normal["latency_ms"]["p50"] <= normal["latency_ms"]["p99"]
    overload = json.loads(out.read_text())
    assert exit_code == 0
    assert overload["rejected_429"] > 0 and overload["errors"] == 0 and overload["healthy_after"]
    assert overload["ok"] + overload["rejected_429"] == 60 and overload["images"] == overload["ok"]
    sampled = {seed for _, _, seeds in fake_factory.calls for seed in seeds}
    assert len(sampled) == overload["ok"] + normal["ok"]  # every accepted request was sampled, no rejected one


def test_batch_buckets(fake_factory):
    app = create_app("fake", pipeline_factory=fake_factory, max_batch=8, batch_buckets=[4, 1])
    batcher = app.state.batcher
    assert batcher.buckets == (1, 4, 8)
    assert [batcher.run_size(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]


def test_cli_errors(capsys):
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--requests", "1"]) == 2
    assert "fastdiff: error: no healthy fastdiff server at http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["serve", "--model", "no-such-model", "--device", "cpu"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["serve", "--max-batch", "4", "--batch-buckets", "2,8", "--device", "cpu"]) == 2
    assert "batch bucket 8 is outside 1..4" in capsys.readouterr().err


def test_a_request_that_finds_the_service_idle_starts_at_once(fake_factory):
    """``idle_start``: no wait for company when none is expected (the last batch answered one request and none
    arrived while it ran; also the first request). After a batch that answered two requests, a lone request waits
    ``max_wait_s``; with ``idle_start`` off, every lone request waits."""
    import time

    from fastdiff.serve.batcher import Batcher, BatchKey
    from fastdiff.serve.metrics import ServiceMetrics

    max_wait = 1.0
    key = BatchKey("ddim", 5)

    def seconds(batcher: Batcher, seed: int) -> float:
        start = time.perf_counter()
        batcher.submit(key, [seed]).future.result(10)
        return time.perf_counter() - start

    batcher = Batcher(fake_factory, ServiceMetrics(4), 4, max_wait, 8, pad_wait=0.0)
    batcher.start()
    try:
        assert seconds(batcher, 1) < max_wait / 2, "the first request waited"
        assert seconds(batcher, 2) < max_wait / 2, "a request after a batch of one waited"
        fake_factory.gate.clear()  # hold the next batch while two more requests arrive
        pipe = fake_factory.pipelines[-1]
        pipe.entered.clear()
        running = batcher.submit(key, [3])
        assert pipe.entered.wait(10)
        company = [batcher.submit(key, [seed]) for seed in (4, 5)]
        fake_factory.gate.set()
        running.future.result(10)
        assert [job.future.result(10).batch_images for job in company] == [2, 2]
        assert seconds(batcher, 6) >= max_wait * 0.9, "a request after a batch of two did not wait for company"
        assert seconds(batcher, 7) < max_wait / 2
    finally:
        batcher.stop()
    patient = Batcher(fake_factory, ServiceMetrics(4), 4, max_wait, 8, pad_wait=0.0, idle_start=False)
    patient.start()
    try:
        assert seconds(patient, 8) >= max_wait * 0.9, "idle_start=False: a lone request started at once"
    finally:
        patient.stop()


@pytest.mark.parametrize("pad_wait", [0.0, 0.5])
def test_a_batch_that_would_run_padded_waits_for_company(fake_factory, pad_wait):
    """Run sizes 1 and 4: two requests, then two more 0.1 s later. Without ``pad_wait`` the first two run padded to 4
    (seeds repeated); with it they wait, up to half of the size-4 run's time (1 s), and all four run together. A
    lone request is never held: its batch is not padded."""
    import time

    from fastdiff.serve.batcher import Batcher, BatchKey
    from fastdiff.serve.metrics import ServiceMetrics

    batcher = Batcher(fake_factory, ServiceMetrics(4), 4, 0.005, 8, [1, 4], pad_wait=pad_wait, idle_start=False)
    batcher._run_seconds[4] = 1.0  # as warm-up would measure it
    key = BatchKey("ddim", 5)
    batcher.start()
    try:
        start = time.perf_counter()
        alone = batcher.submit(key, [9]).future.result(10)
        assert time.perf_counter() - start < 0.5 and len(alone.images) == 1
        first = [batcher.submit(key, [seed]) for seed in (1, 2)]
        time.sleep(0.1)
        second = [batcher.submit(key, [seed]) for seed in (3, 4)]
        for job in first + second:
            job.future.result(10)
    finally:
        batcher.stop()
    runs = [seeds for _, _, seeds in fake_factory.calls[-3:]]
    if pad_wait:
        assert fake_factory.calls[-1][2] == [1, 2, 3, 4] and fake_factory.calls[-2][2] == [9]
    else:
        assert runs[-2:] == [[1, 2, 2, 2], [3, 4, 4, 4]]


def test_images_json_is_the_json_of_the_answer():
    """The answer's JSON with the base64 PNGs spliced in as bytes parses to the same object as ``json.dumps``'s."""
    from fastdiff.serve.app import images_json

    pngs = [base64.b64encode(bytes(range(256)) * 3), base64.b64encode(b"\x89PNG")]
    prompt = 'a "quoted" caf\u00e9 \u2603\n'
    body = {"model": "fake", "parameters": {"prompt": prompt}, "warnings": [], "timing": {"x": 1.5}}
    expected = body | {"images": [{"seed": s, "png_base64": p.decode()} for s, p in zip((7, 8), pngs, strict=True)]}
    assert json.loads(images_json(body, [7, 8], pngs)) == expected
    assert json.loads(images_json({}, [], [])) == {"images": []}
