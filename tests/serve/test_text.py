"""fastdiff serve with text-to-image models: the request schema (prompt or prompts, sizes, img2img), one-line 422s
before any sampling, batching by (sampler, steps, size, guided, strength) on one pipeline with one row per image,
the bundled fashion-mnist-t2i's images byte-identical alone or batched, with their parameters and warnings."""

from __future__ import annotations

import base64
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402  (after the importorskip)

from fastdiff.cli import main  # noqa: E402
from fastdiff.errors import FastdiffError  # noqa: E402
from fastdiff.serve.app import batch_key, create_app  # noqa: E402
from fastdiff.serve.loadtest import run_loadtest  # noqa: E402
from fastdiff.serve.schema import (  # noqa: E402
    DEFAULT_STRENGTH,
    ImageRequest,
    ModelInfo,
    RequestError,
    parse_request,
    resolve_request,
)

TEXT_INFO = ModelInfo(
    "sd", True, 3, 32, 32, ("ddim", "euler"), "ddim", 20, 4, 1000, "cpu",
    default_guidance=7.5, size_multiple=16, max_side=64, img2img=True,
)  # fmt: skip


def png_base64(width: int, height: int, value: int = 128) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, value)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def resolve(body: dict, info: ModelInfo = TEXT_INFO, warnings=None):
    return resolve_request(parse_request(json.dumps(body).encode()), info, warnings)


def png_parameters(png: bytes) -> dict:
    with Image.open(io.BytesIO(png)) as image:
        return json.loads(image.text["parameters"])


def test_text_request_schema():
    checked: list[list[str]] = []

    def warnings(texts: list[str]) -> list[str]:
        checked.append(texts)
        return [f"about {text}" for text in texts if "zz" in text]

    one = resolve({"prompt": "a zz cat", "negative_prompt": "dog", "seed": 9, "n": 2}, warnings=warnings)
    assert one.seeds == [9, 10] and one.guidance == 7.5 and one.size == (32, 32) and one.strength is None
    assert one.image_prompts() == ["a zz cat"] * 2 and one.warnings == ["about a zz cat"]
    assert checked == [["a zz cat", "dog"]]
    assert one.image_parameters("sd")[1] == {"model": "sd", "prompt": "a zz cat", "negative_prompt": "dog",
        "steps": 20, "sampler": "ddim", "guidance": 7.5, "size": [32, 32], "seed": 10}  # fmt: skip

    each = resolve({"prompts": ["boot", "bag", "boot"], "seeds": [4, 2, 7], "guidance": 1, "negative_prompt": "x"})
    assert each.image_prompts() == ["boot", "bag", "boot"] and each.prompt is None and each.seeds == [4, 2, 7]
    assert [p["prompt"] for p in each.image_parameters("sd")] == ["boot", "bag", "boot"]
    assert each.parameters()["prompts"] == ["boot", "bag", "boot"] and each.parameters()["n"] == 3
    assert each.warnings == ["negative_prompt is unused: guidance 1 <= 1 runs the model without it"]
    assert resolve({"prompts": ["a", "b"], "seed": 5}).seeds == [5, 6]

    assert resolve({"prompt": "a", "width": 64}).size == (32, 64)
    assert resolve({"prompt": "a", "size": [48, 16]}).size == (48, 16)
    img2img = resolve({"prompt": "a", "init_image": png_base64(64, 16)})
    assert img2img.size == (16, 64) and img2img.strength == DEFAULT_STRENGTH  # the init image's size
    assert img2img.init_image.size == (64, 16) and img2img.init_image.mode == "RGB"
    assert img2img.image_parameters("sd")[0]["strength"] == DEFAULT_STRENGTH
    data_url = resolve({"prompt": "a", "init_image": "data:image/png;base64," + png_base64(32, 32), "strength": 1})
    assert data_url.strength == 1.0 and data_url.size == (32, 32)

    late = resolve({"prompt": "a", "guidance_interval": [0.2, 1]})
    assert late.guidance_interval == (0.2, 1.0) and late.image_parameters("sd")[0]["guidance_interval"] == [0.2, 1.0]
    assert batch_key(late) != batch_key(resolve({"prompt": "a"}))  # one sampler table per batch
    every = resolve({"prompt": "a", "guidance_interval": [0, 1]})
    assert every.guidance_interval is None and "guidance_interval" not in every.image_parameters("sd")[0]
    assert batch_key(every) == batch_key(resolve({"prompt": "a"}))
    unguided = resolve({"prompt": "a", "guidance": 1, "guidance_interval": [0.5, 1]})
    assert unguided.guidance_interval is None and unguided.warnings == [
        "guidance_interval is unused: guidance 1 <= 1 guides no step"
    ]


TEXT_BAD_REQUESTS = [
    ("", 'the request is empty: send a JSON object such as {"prompt": "a red dress", "n": 2}'),
    ("{}", "the request is empty"),
    ('{"n": 2}', "'prompt' (or 'prompts') is required"),
    ('{"prompt": ""}', "'prompt' (or 'prompts') is required"),
    ('{"prompt": "a", "prompts": ["b"]}', "either prompt (every image) or prompts"),
    ('{"prompts": []}', "prompts: List should have at least 1 item"),
    ('{"prompts": ["a", ""]}', "prompts.1: String should have at least 1 character"),
    ('{"prompts": ["a", "b"], "n": 3}', "n=3 but 2 prompts"),
    ('{"prompts": ["a", "b"], "seeds": [1]}', "1 seeds for 2 prompts"),
    ('{"prompts": ["a", "b", "c", "d", "e"]}', "n=5 is more than this server's limit of 4"),
    ('{"prompt": "a", "colour": "red"}', "colour: Extra inputs are not permitted"),
    ('{"prompt": "a", "guidance": -1}', "guidance: Input should be greater than or equal to 0"),
    ('{"prompt": "a", "size": 24}', "size 24x24 is not available: model 'fake-t2i' makes heights and widths that"),
    ('{"prompt": "a", "width": 80}', "size 32x80 is not available"),
    ('{"prompt": "a", "size": 32, "width": 32}', "either size or width/height"),
    ('{"prompt": "a", "init_image": "not base64!"}', "init_image: not valid base64"),
    ('{"prompt": "a", "init_image": "aGVsbG8="}', "init_image: not a PNG or JPEG image"),
    (f'{{"prompt": "a", "init_image": "{png_base64(128, 32)}"}}', "init_image is 32x128: model 'fake-t2i' makes"),
    (f'{{"prompt": "a", "init_image": "{png_base64(48, 32)}", "size": 32}}', "init_image is 32x48 (height x"),
    (f'{{"prompt": "a", "init_image": "{png_base64(32, 32)}", "strength": 0}}', "strength: Input should be greater"),
    (f'{{"prompt": "a", "init_image": "{png_base64(32, 32)}", "strength": 1.5}}', "strength: Input should be less"),
    ('{"prompt": "a", "strength": 0.5}', "strength is for img2img: it needs init_image"),
    ('{"prompt": "a", "guidance_interval": [0.9, 0.1]}', "guidance_interval needs 0 <= start < 1 and start <= stop"),
    ('{"prompt": "a", "guidance_interval": [0.5]}', "guidance_interval"),
    (f'{{"prompt": "a", "init_image": "{png_base64(32, 32)}", "strength": 0.1, "steps": 5}}', "leaves none of the 5"),
]


def test_text_bad_requests_get_one_line_422_before_sampling(fake_text_factory):
    app = create_app("fake-t2i", pipeline_factory=fake_text_factory, steps=5, max_batch=4)
    info = app.state.model_info
    assert info.conditional and info.default_guidance == 7.5 and (info.size_multiple, info.max_side) == (16, 64)
    with TestClient(app) as client:
        assert client.get("/v1/model").json()["default_guidance"] == 7.5
        for body, message in TEXT_BAD_REQUESTS:
            response = client.post("/v1/images", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 422, body
            error = response.json()["error"]
            assert message in error and "\n" not in error, (body[:80], error)
    assert fake_text_factory.calls == [] and fake_text_factory.loads == 1


def test_compatible_text_requests_share_a_batch_with_one_row_per_image(fake_text_factory, serve_app, waiter):
    """With the worker held in a first batch, the queued requests leave in batches of equal (sampler, steps, size,
    guided, strength), in arrival order, each padded to the run size with its last row; one pipeline serves all and
    keeps at most ``MAX_PIPELINES`` kinds of batch prepared."""
    init = png_base64(32, 32)
    bodies = [
        {"prompt": "red dress", "seed": 1, "guidance": 5},
        {"prompts": ["bag", "boot"], "seeds": [2, 3], "negative_prompt": "blurry", "guidance": 2},
        {"prompt": "shirt", "seed": 4, "guidance": 1},  # unguided
        {"prompt": "coat", "seed": 5, "size": 64},
        {"prompt": "sneaker", "seed": 6, "steps": 3},
        {"prompt": "hat", "seed": 7, "sampler": "euler"},
        {"prompt": "sandal", "seed": 8, "init_image": init, "strength": 0.5},
        {"prompt": "pullover", "seed": 9, "init_image": init, "strength": 0.5, "guidance": 4},
        {"prompt": "trouser", "seed": 10, "init_image": init, "strength": 0.75},
    ]
    app = create_app("fake-t2i", pipeline_factory=fake_text_factory, steps=5, max_batch=4, max_wait_ms=0)
    calls, gate = fake_text_factory.calls, fake_text_factory.gate
    gate.clear()
    with serve_app(app) as url, ThreadPoolExecutor(len(bodies) + 1) as pool:
        post = lambda body: httpx.post(f"{url}/v1/images", json=body, timeout=30)  # noqa: E731
        blocker = pool.submit(post, {"prompt": "first", "seed": 0})
        waiter(lambda: calls, "the first batch to start")
        answers = []
        for k, body in enumerate(bodies):
            answers.append(pool.submit(post, body))
            waiter(lambda k=k: app.state.batcher.depth()[0] == k + 1, "the request to queue")
        gate.set()
        responses = [blocker.result()] + [answer.result() for answer in answers]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert fake_text_factory.loads == 1
    # seven kinds of batch: the fifth (sampler euler) dropped what the first four had prepared (MAX_PIPELINES = 4)
    assert fake_text_factory.made[0].cleared == 1
    batches = [(call["prompt"], call["seeds"]) for call in calls]
    assert batches == [
        (["first"] * 4, [0] * 4),
        (["red dress", "bag", "boot", "boot"], [1, 2, 3, 3]),
        (["shirt"] * 4, [4] * 4),
        (["coat"] * 4, [5] * 4),
        (["sneaker"] * 4, [6] * 4),
        (["hat"] * 4, [7] * 4),
        (["sandal", "pullover", "pullover", "pullover"], [8, 9, 9, 9]),
        (["trouser"] * 4, [10] * 4),
    ]
    shared = calls[1]
    assert shared["negative_prompt"] == ["", "blurry", "blurry", "blurry"]
    assert shared["guidance_scale"] == [5.0, 2.0, 2.0, 2.0] and shared["image"] is None and "strength" not in shared
    assert (shared["height"], shared["width"], shared["steps"], shared["sampler"]) == (32, 32, 5, "ddim")
    assert calls[2]["guidance_scale"] == [1.0] * 4 and (calls[3]["height"], calls[3]["width"]) == (64, 64)
    assert calls[4]["steps"] == 3 and calls[5]["sampler"] == "euler"
    assert calls[6]["strength"] == 0.5 and len(calls[6]["image"]) == 4 and calls[7]["strength"] == 0.75
    assert calls[6]["guidance_scale"] == [7.5, 4.0, 4.0, 4.0]
    for body, response in zip(bodies, responses[1:], strict=True):
        data = response.json()
        assert data["warnings"] == [] and data["parameters"]["size"] == [body.get("size", 32)] * 2
        for image, seed in zip(data["images"], body.get("seeds", [body.get("seed")]), strict=True):
            with Image.open(io.BytesIO(base64.b64decode(image["png_base64"]))) as png:
                assert image["seed"] == seed and png.getpixel((0, 0)) == seed


def test_loadtest_draws_prompts_round_robin(fake_text_factory, serve_app, tmp_path, capsys):
    app = create_app("fake-t2i", pipeline_factory=fake_text_factory, max_batch=2, max_wait_ms=5)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ankle boot\n\n  a red dress \nbag\n")
    with serve_app(app) as url:
        summary = run_loadtest(url, concurrency=2, requests=6, prompts=["one", "two"])
        assert main(["loadtest", "--url", url, "--requests", "5", "--concurrency", "1", "--prompts", str(prompts)]) == 0
    assert summary["ok"] == 6 and summary["errors"] == 0 and summary["prompts"] == 2
    drawn = [prompt for call in fake_text_factory.calls for prompt in call["prompt"]]
    assert {"one", "two"} <= set(drawn) and {"ankle boot", "a red dress", "bag"} <= set(drawn)
    with serve_app(app) as url:
        with pytest.raises(FastdiffError, match="runs a text-to-image model: give prompts"):
            run_loadtest(url, concurrency=1, requests=1)
    prompts.write_text("\n  \n")
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--prompts", str(prompts)]) == 2
    assert "holds no prompt" in capsys.readouterr().err


def post_together(url: str, bodies: list[dict]) -> list[dict]:
    """POST ``bodies`` to ``/v1/images`` at once (one client thread each, released together); the JSON answers."""
    barrier = threading.Barrier(len(bodies))

    def send(body: dict) -> dict:
        barrier.wait()
        with httpx.Client(base_url=url, timeout=120) as own:
            response = own.post("/v1/images", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def test_bundled_model_images_are_byte_identical_alone_or_batched(t2i_app, serve_app):
    """fashion-mnist-t2i on the CPU: a request alone and the same request batched with one of another prompt and
    guidance give the same PNG bytes; each answer carries its own prompt warnings and each PNG its parameters."""
    info = t2i_app.state.model_info
    assert info.conditional and info.default_guidance == 3.0 and (info.height, info.width, info.channels) == (32, 32, 1)
    first = {"prompt": "ankle boot", "seed": 5}
    other = {"prompt": "a photo of a zzyzx bag", "negative_prompt": "shirt", "seeds": [9], "guidance": 5.0}
    with serve_app(t2i_app) as url, httpx.Client(base_url=url, timeout=120) as client:
        alone = client.post("/v1/images", json=first).json()
        together, with_other = post_together(url, [first, other])
    assert alone["timing"]["batch_images"] == 1 and together["timing"]["batch_images"] == 2
    assert with_other["timing"]["batch_images"] == 2
    png = base64.b64decode(alone["images"][0]["png_base64"])
    assert base64.b64decode(together["images"][0]["png_base64"]) == png
    other_png = base64.b64decode(with_other["images"][0]["png_base64"])
    assert other_png != png
    assert alone["warnings"] == [] and together["warnings"] == []
    assert len(with_other["warnings"]) == 1 and "zzyzx" in with_other["warnings"][0]
    assert png_parameters(png) | {"fastdiff": None} == {"model": "fashion-mnist-t2i", "prompt": "ankle boot",
        "steps": 2, "sampler": "ddim", "guidance": 3.0, "size": [32, 32], "seed": 5, "dtype": "fp32",
        "fastdiff": None}  # fmt: skip
    assert png_parameters(other_png)["negative_prompt"] == "shirt" and png_parameters(other_png)["seed"] == 9
    with Image.open(io.BytesIO(png)) as image:
        assert image.size == (32, 32) and image.mode == "L"


def test_image_request_fields_are_documented():
    schema = ImageRequest.model_json_schema()["properties"]
    for name in ("prompt", "prompts", "negative_prompt", "guidance", "width", "height", "init_image", "strength"):
        assert schema[name].get("description"), name
    with pytest.raises(RequestError, match="the request is empty"):
        resolve({}, TEXT_INFO)


@pytest.mark.slow
def test_img2img_on_a_stable_diffusion_directory_alone_or_batched(tmp_path, serve_app):
    """A tiny SD 1.5 directory (RGB VAE): /v1/model offers img2img; an img2img request's PNG is the same bytes alone
    or batched with another of a different prompt, and records its strength; a text-only request beside it runs in
    a batch of its own."""
    pytest.importorskip("diffusers")
    from sd_fixtures import write_tiny_sd_pipeline

    root = tmp_path / "sd15"
    write_tiny_sd_pipeline(root, "sd15", seed=3)
    app = create_app(str(root), device="cpu", steps=4, max_batch=2, max_wait_ms=300, idle_start=False)
    info = app.state.model_info
    assert info.img2img and info.default_guidance == 7.5 and info.channels == 3 and info.size_multiple == 64
    init = png_base64(info.width, info.height, 90)
    first = {"prompt": "a cat", "seed": 3, "init_image": init, "strength": 0.5}
    second = {"prompt": "a dog", "seed": 4, "init_image": init, "strength": 0.5, "guidance": 3}
    plain = {"prompt": "a cat", "seed": 3}
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        alone = client.post("/v1/images", json=first).json()
        together, _, text_only = post_together(url, [first, second, plain])
    assert alone["timing"]["batch_images"] == 1 and together["timing"]["batch_images"] == 2
    assert text_only["timing"]["batch_images"] == 1
    png = base64.b64decode(alone["images"][0]["png_base64"])
    assert base64.b64decode(together["images"][0]["png_base64"]) == png
    assert base64.b64decode(text_only["images"][0]["png_base64"]) != png
    parameters = png_parameters(png)
    assert parameters["strength"] == 0.5 and parameters["prompt"] == "a cat" and parameters["guidance"] == 7.5
    assert "strength" not in png_parameters(base64.b64decode(text_only["images"][0]["png_base64"]))


def test_text_warmup_and_png_answer_with_warnings(fake_text_factory):
    app = create_app("fake-t2i", pipeline_factory=fake_text_factory, max_batch=4, batch_buckets=[1], warmup=True)
    warmups = fake_text_factory.calls
    assert [len(call["prompt"]) for call in warmups] == [1, 4, 1, 4] and warmups[0]["prompt"] == [""]  # then timed
    assert warmups[1]["guidance_scale"] == [7.5] * 4 and (warmups[1]["height"], warmups[1]["width"]) == (32, 32)
    with TestClient(app) as client:
        body = {"prompt": "a cat", "negative_prompt": "dog", "guidance": 0.5, "seed": 12}
        response = client.post("/v1/images", json=body, headers={"accept": "image/png"})
    assert response.status_code == 200 and response.headers["content-type"] == "image/png"
    assert json.loads(response.headers["x-fastdiff-warnings"]) == [
        "negative_prompt is unused: guidance 0.5 <= 1 runs the model without it"
    ]
    assert png_parameters(response.content)["prompt"] == "a cat" and response.headers["x-fastdiff-seed"] == "12"
    assert fake_text_factory.calls[-1]["seeds"] == [12]  # a batch of 1 runs at the bucket of 1


def test_served_images_equal_fastdiff_sample(t2i_app, serve_app, tmp_path):
    """The served bundled model gives `fastdiff sample`'s pixels for the same prompt, seeds, steps and guidance (the
    server runs every batch at its one run size, 4 here: sample draws the same 4 images in one call)."""
    from fastdiff.cli import main

    body = {"prompt": "a photo of a sneaker", "negative_prompt": "a sandal", "seed": 11, "n": 4, "guidance": 3.0}
    for interval in (None, [0.5, 1.0]):  # and with the first of the two steps unguided
        request = body if interval is None else {**body, "guidance_interval": interval}
        with serve_app(t2i_app) as url, httpx.Client(base_url=url, timeout=120) as client:
            served = client.post("/v1/images", json=request).json()
        assert served["timing"]["run_batch_size"] == 4
        folder = tmp_path / f"sampled-{interval}"
        flags = ["sample", "--model", "fashion-mnist-t2i", "--prompt", body["prompt"], "--negative-prompt",
                 "a sandal", "--guidance", "3", "--seed", "11", "--batch", "4", "--steps", "2", "--sampler", "ddim",
                 "--device", "cpu", "--no-progress", "--out", str(folder / "grid.png"), "--save-dir", str(folder),
                 *([] if interval is None else ["--guidance-interval", "0.5", "1"])]  # fmt: skip
        assert main(flags) == 0
        for image in served["images"]:
            with Image.open(io.BytesIO(base64.b64decode(image["png_base64"]))) as png:
                ours = np.asarray(png)
            with Image.open(folder / f"{image['seed']:06d}.png") as png:
                assert np.array_equal(ours, np.asarray(png)), (interval, image["seed"])
