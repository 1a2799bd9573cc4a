"""benchmarks/serve_reference.py (the diffusers reference server of scripts/gpu_loadtest_t2i.sh) on a tiny SD 1.5
directory on the CPU: the same routes and JSON shape as fastdiff serve on the same directory, its one-line errors,
the random-directory writer round trip; and the overload and memory accounting of fastdiff loadtest."""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402  (after the importorskip)

from fastdiff.serve.loadtest import Answer, memory_growth, prometheus_gauges, sample_memory, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_reference():
    spec = importlib.util.spec_from_file_location("serve_reference", ROOT / "benchmarks" / "serve_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from sd_fixtures import write_tiny_sd_pipeline

    root = tmp_path_factory.mktemp("reference") / "sd15"
    write_tiny_sd_pipeline(root, "sd15", seed=5)
    return root


def shape(value):
    """The keys of every dict, recursively (list items: the first one's), without the values."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


@pytest.mark.slow
def test_reference_answers_like_fastdiff_serve_on_the_same_directory(tiny_sd):
    """One text request to each server (diffusers vs fastdiff on the CPU, same directory): the same JSON shape of
    /v1/images, /v1/model and /health, the same echoed parameters and PNG parameters, decodable PNGs of the default
    size; the reference refuses img2img and other samplers with one-line 422s."""
    from fastdiff.serve.app import create_app

    reference = load_reference().create_reference_app(
        str(tiny_sd), device="cpu", dtype="fp32", compile_unet=False, steps=2, max_images=2, warmup=False
    )
    engine = create_app(str(tiny_sd), device="cpu", steps=2, max_batch=2, max_wait_ms=0)
    body = {"prompt": "a red cat", "negative_prompt": "dog", "n": 2, "seed": 7}
    answers = {}
    for name, app in (("reference", reference), ("fastdiff", engine)):
        with TestClient(app) as client:
            response = client.post("/v1/images", json=body)
            assert response.status_code == 200, response.text
            answers[name] = {
                "images": response.json(),
                "model": client.get("/v1/model").json(),
                "health": client.get("/health").json(),
            }
            if name == "reference":
                refused = [
                    client.post("/v1/images", json={"prompt": "a", "init_image": "AAAA"}),
                    client.post("/v1/images", json={"prompt": "a", "sampler": "euler"}),
                    client.post("/v1/images", json={"n": 1}),
                ]
                assert [r.status_code for r in refused] == [422, 422, 422]
                assert all("\n" not in r.json()["error"] for r in refused)
                assert "init_image" in refused[0].json()["error"] and "euler" in refused[1].json()["error"]
                assert "fastdiff_queue_depth 0" in client.get("/metrics").text
    ref, fd = answers["reference"], answers["fastdiff"]
    assert shape(ref["images"]) == shape(fd["images"])
    assert ref["images"]["parameters"] == fd["images"]["parameters"]
    assert ref["images"]["warnings"] == fd["images"]["warnings"]
    assert ref["model"].keys() == fd["model"].keys() and ref["health"].keys() == fd["health"].keys()
    for key in ("height", "width", "channels", "size_multiple", "max_side", "default_guidance", "default_steps"):
        assert ref["model"][key] == fd["model"][key], key
    assert ref["model"]["samplers"] == ["ddim"] and ref["model"]["img2img"] is False
    assert ref["images"]["timing"]["batch_images"] == 2 == ref["images"]["timing"]["run_batch_size"]
    assert [image["seed"] for image in ref["images"]["images"]] == [7, 8]
    for name in ("reference", "fastdiff"):
        png = base64.b64decode(answers[name]["images"]["images"][1]["png_base64"])
        with Image.open(io.BytesIO(png)) as image:
            assert image.size == (fd["model"]["width"], fd["model"]["height"])
            parameters = image.text["parameters"]
        assert '"seed": 8' in parameters and '"prompt": "a red cat"' in parameters
    fd_png = base64.b64decode(fd["images"]["images"][1]["png_base64"])
    ref_png = base64.b64decode(ref["images"]["images"][1]["png_base64"])
    with Image.open(io.BytesIO(fd_png)) as a, Image.open(io.BytesIO(ref_png)) as b:
        assert a.text == b.text  # the same parameters recorded, however the pixels were sampled


@pytest.mark.slow
def test_write_sd_directory_round_trips_through_both_loaders(tiny_sd, tmp_path):
    """Components loaded from a directory and written again (fp16) load in fastdiff and in diffusers, with the
    same weights (rounded to fp16) and the same scheduler and tokenizer."""
    diffusers = pytest.importorskip("diffusers")
    from fastdiff.models.stable_diffusion import load_stable_diffusion

    reference = load_reference()
    comps = load_stable_diffusion(tiny_sd)
    out = reference.write_sd_directory(tmp_path / "copy", comps, torch.float16)
    again = load_stable_diffusion(out)
    for name in ("unet", "vae", "text_encoder"):
        before, after = getattr(comps, name).state_dict(), getattr(again, name).state_dict()
        assert before.keys() == after.keys()
        for key, tensor in before.items():
            assert torch.equal(tensor.half().float(), after[key].float()), (name, key)
    assert again.scheduler_config["_class_name"] == comps.scheduler_config["_class_name"]
    assert again.tokenizer("a red cat").input_ids == comps.tokenizer("a red cat").input_ids
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(out), safety_checker=None)
    assert torch.equal(pipe.unet.conv_in.weight.float(), again.unet.conv_in.weight.float())
    with pytest.raises(Exception, match="already holds a pipeline"):
        reference.write_sd_directory(out, comps)


def test_overload_accounting_counts_every_request():
    """200s and 429s are answered; errors and missing answers are lost; status counts by code."""
    answers = [Answer(200, 0.1, images=1, batch_images=4), Answer(429, 0.01), Answer(429, 0.01)]
    config = {"requests": 3}
    clean = summarize(answers, 1.0, config, healthy_after=True)
    assert clean["status_counts"] == {"200": 1, "429": 2} and clean["lost"] == 0 and clean["all_answered"]
    assert clean["ok"] == 1 and clean["rejected_429"] == 2 and clean["errors"] == 0
    broken = answers + [Answer(0, 5.0, error="ReadTimeout: x"), Answer(500, 0.2, error="500: boom")]
    summary = summarize(broken, 2.0, {"requests": 6}, healthy_after=False)
    assert summary["status_counts"] == {"0": 1, "200": 1, "429": 2, "500": 1}
    assert summary["lost"] == 3 and not summary["all_answered"] and summary["errors"] == 2  # one never answered


def test_the_summary_splits_the_latency_where_the_server_says():
    """Medians of the answers' own timing, and of the time outside the server; None when no answer has a timing."""
    times = [{"queue_ms": q, "sample_ms": 130.0, "total_ms": q + 138.0} for q in (5.0, 6.0, 7.0)]
    answers = [Answer(200, (t["total_ms"] + 9.0) / 1000, 1, 1, server_ms=t) for t in times]
    split = summarize(answers, 1.0, {"requests": 3}, healthy_after=True)["server_p50_ms"]
    assert split == {"queue_ms": 6.0, "sample_ms": 130.0, "total_ms": 144.0, "outside_ms": pytest.approx(9.0)}
    assert summarize([Answer(200, 0.1, 1, 1)], 1.0, {"requests": 1}, healthy_after=True)["server_p50_ms"] is None


def test_memory_sampling_reads_rss_and_the_torch_gauges():
    text = "# TYPE fastdiff_gpu_memory_allocated_bytes gauge\nfastdiff_gpu_memory_allocated_bytes 1048576\nother 3\n"
    assert prometheus_gauges(text, ["fastdiff_gpu_memory_allocated_bytes"]) == {
        "fastdiff_gpu_memory_allocated_bytes": 1048576.0
    }
    sample = sample_memory(None, os.getpid())
    if Path("/proc/self/status").exists():
        assert sample["rss_mib"] > 0
    before = {"rss_mib": 100.0, "gpu_process_mib": None, "torch_allocated_mib": 10.0, "time": 1.0}
    after = {"rss_mib": 103.5, "gpu_process_mib": 5.0, "torch_allocated_mib": 10.0, "time": 9.0}
    assert memory_growth(before, after) == {"rss_mib": 3.5, "torch_allocated_mib": 0.0}


@pytest.mark.slow  # importing torch._inductor takes about 2 s
def test_the_worker_thread_gets_the_cudagraph_tree_state():
    """torch.compile(mode="reduce-overhead") looks its CUDA-graph trees up in thread-local state that older torch
    releases set up on the importing thread only: the reference's worker thread sets up its own."""
    trees = pytest.importorskip("torch._inductor.cudagraph_trees")
    reference = load_reference()
    seen = {}

    def worker() -> None:
        reference.init_cudagraph_tls()
        seen["state"] = hasattr(trees.local, "tree_manager_containers")
        seen["container"] = trees.get_container(0) is trees.get_container(0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"state": True, "container": True}
