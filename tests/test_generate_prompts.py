"""``fastdiff generate --prompts FILE`` on the bundled text-to-image preset (CPU, 2 steps): the PNGs and their
parameters, the image list (n, seeds, repeats), resume after a failure, the manifest's checks, one process vs
``torchrun`` with gloo, and every bad prompts file refused in one line before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchrun_helpers import kill_rank_1_script, torchrun

import fastdiff.generate as generate_module
from fastdiff.cli import main
from fastdiff.generate import PromptJob
from fastdiff.pipelines import Pipeline
from fastdiff.prompts_file import PromptLine, read_prompts

pytest.importorskip("transformers")

MODEL = "fashion-mnist-t2i"
FIRST_SEED = 5
NUM_IMAGES = 7  # the file lists 5 images: images 5 and 6 repeat the first line; batch 2: chunks 0-1, 2-3, 4-5, 6
PROMPTS_JSONL = (
    '{"prompt": "ankle boot", "n": 2, "seed": 40}\n'
    "\n"
    '{"prompt": "bag", "negative_prompt": "sneaker", "guidance": 3}\n'
    '{"prompt": "ankle boot", "seed": 40, "n": 2, "guidance": 5}\n'
)
# image index -> (prompt, negative prompt, guidance, seed): seeds 40, 41 on lines 1 and 4 (names are by index)
EXPECTED = [
    ("ankle boot", "", 7.5, 40),
    ("ankle boot", "", 7.5, 41),
    ("bag", "sneaker", 3.0, FIRST_SEED + 2),
    ("ankle boot", "", 5.0, 40),
    ("ankle boot", "", 5.0, 41),
    ("ankle boot", "", 7.5, 42),  # line 1's third image: its seed counts on over the repeat
    ("ankle boot", "", 7.5, 43),
]
EMPTY_SHA256 = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""The hash of no files: what a model path that names nothing would give."""
PNG_NAMES = {f"{index:06d}.png" for index in range(NUM_IMAGES)}


def prompts_argv(prompts: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", MODEL, "--prompts", str(prompts), "--out-dir", str(out_dir), "--first-seed",
        str(FIRST_SEED), "--steps", "2", "--batch", "2", "--device", "cpu", "--no-progress", *extra,
    ]  # fmt: skip


def folder_pngs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".png"}


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".png"}


def error_lines(capsys) -> list[str]:
    """stderr's lines, less transformers' "Loading weights" progress bar (shown while the text encoder loads)."""
    return [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]


def parameters(path: Path) -> dict:
    return json.loads(Image.open(path).text["parameters"])


@pytest.fixture
def one_thread():
    """One torch thread, as each torchrun rank runs (and the reference was made)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(PROMPTS_JSONL)
    return path


@pytest.fixture(scope="module")
def reference(prompts_file, tmp_path_factory) -> Path:
    """The uninterrupted one-process run (one thread): the files every other run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(prompts_argv(prompts_file, out, "--num-images", str(NUM_IMAGES))) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_prompts_file_writes_one_png_per_image_with_its_parameters(reference, prompts_file, one_thread):
    assert {p.name for p in reference.iterdir()} == PNG_NAMES | {"manifest.json", "summary.json"}
    for index, (prompt, negative, guidance, seed) in enumerate(EXPECTED):
        found = parameters(reference / f"{index:06d}.png")
        assert found["fastdiff"] and found.pop("fastdiff")
        assert found == {
            "prompt": prompt, "negative_prompt": negative, "guidance": guidance, "seed": seed, "model": MODEL,
            "sampler": "ddim", "steps": 2, "dtype": "fp32", "height": 32, "width": 32,
        }  # fmt: skip
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["prompts_sha256"].startswith("sha256:") and manifest["prompts_file"] == str(prompts_file)
    assert (manifest["first_seed"], manifest["guidance"], manifest["negative_prompt"]) == (FIRST_SEED, 7.5, "")
    assert [entry["line"] for entry in manifest["prompts"]] == [1, 3, 4]
    assert manifest["prompts"][1] == {
        "line": 3, "prompt": "bag", "negative_prompt": "sneaker", "guidance": 3.0, "seed": None, "n": 1
    }  # fmt: skip
    assert manifest["model_hash"].startswith("sha256:") and manifest["model_hash"] != EMPTY_SHA256
    assert manifest["num_images"] == NUM_IMAGES and manifest["image_ranges"] == [[0, NUM_IMAGES - 1]]
    assert manifest["image_size"] == [32, 32] and manifest["channels"] == 1
    # images 2 and 3 are the pipeline's images of that chunk, sampled together at batch 2
    pipe = Pipeline.from_pretrained(MODEL, device="cpu", steps=2)
    chunk = pipe(
        ["bag", "ankle boot"], negative_prompt=["sneaker", ""], guidance_scale=[3.0, 5.0], seeds=[FIRST_SEED + 2, 40],
        output_type="tensor", progress=False,
    )  # fmt: skip
    expected = ((chunk.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[:, 0].numpy()
    for index, pixels in zip((2, 3), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(Image.open(reference / f"{index:06d}.png")), pixels)
    # the same prompt and seed on another line (other guidance) is another image under another name
    assert not np.array_equal(
        np.asarray(Image.open(reference / "000000.png")), np.asarray(Image.open(reference / "000003.png"))
    )


def test_guidance_interval_reaches_every_image_its_png_and_the_manifest(tmp_path, one_thread):
    """--guidance-interval: each image is the pipeline's with that guidance_interval; PNGs and manifest record it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ankle boot\nbag\n")
    out = tmp_path / "out"
    assert main(prompts_argv(prompts, out, "--guidance", "4", "--guidance-interval", "0.5", "1")) == 0
    assert parameters(out / "000001.png")["guidance_interval"] == [0.5, 1.0]
    assert json.loads((out / "manifest.json").read_text())["guidance_interval"] == [0.5, 1.0]
    pipe = Pipeline.from_pretrained(MODEL, device="cpu", steps=2)
    kwargs = dict(guidance_scale=4.0, seeds=[FIRST_SEED, FIRST_SEED + 1], output_type="tensor", progress=False)
    images = {span: pipe(["ankle boot", "bag"], guidance_interval=span, **kwargs) for span in ((0.5, 1), (0, 1))}
    expected = ((images[(0.5, 1)].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[:, 0].numpy()
    for index, pixels in enumerate(expected):
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{index:06d}.png")), pixels)
    assert (images[(0.5, 1)] - images[(0, 1)]).abs().max() > 0.01  # the first step unguided: other images


def test_guidance_interval_needs_prompts(tmp_path, capsys):
    argv = ["generate", "--model", "ddpm-cifar10", "--num-images", "1", "--out-dir", str(tmp_path / "o"),
            "--guidance-interval", "0.2", "1", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    assert error_lines(capsys) == ["fastdiff: error: --guidance-interval needs --prompts"]
    argv = prompts_argv(tmp_path / "p.txt", tmp_path / "o", "--guidance-interval", "0.9", "0.1")
    (tmp_path / "p.txt").write_text("bag\n")
    assert main(argv) == 2
    assert "--guidance-interval needs 0 <= start < 1" in error_lines(capsys)[0]


def test_plain_text_prompts_one_image_a_line(tmp_path, one_thread):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ankle boot\n\n   \n  bag  \r\nsneaker")
    out = tmp_path / "out"
    assert main(prompts_argv(prompts, out, "--guidance", "2", "--negative-prompt", "shirt")) == 0
    assert {p.name for p in out.glob("*.png")} == {"000000.png", "000001.png", "000002.png"}
    found = [parameters(out / f"{index:06d}.png") for index in range(3)]
    assert [(f["prompt"], f["seed"], f["guidance"], f["negative_prompt"]) for f in found] == [
        ("ankle boot", FIRST_SEED, 2.0, "shirt"),
        ("bag", FIRST_SEED + 1, 2.0, "shirt"),
        ("sneaker", FIRST_SEED + 2, 2.0, "shirt"),
    ]
    assert [entry["line"] for entry in json.loads((out / "manifest.json").read_text())["prompts"]] == [1, 4, 5]


def test_a_failed_run_then_rerun_gives_the_same_bytes(reference, prompts_file, tmp_path, monkeypatch, one_thread):
    out = tmp_path / "out"
    argv = prompts_argv(prompts_file, out, "--num-images", str(NUM_IMAGES))
    write = generate_module.write_temporary

    def write_but_image_3(path, data):  # image 3 (the second of chunk 2-3) cannot be written
        if path.name == "000003.png":
            raise OSError(28, "No space left on device")
        return write(path, data)

    monkeypatch.setattr(generate_module, "write_temporary", write_but_image_3)
    assert main(argv) == 2
    before = mtimes(out)
    assert {"000000.png", "000001.png"} <= set(before) and "000006.png" not in before
    assert "000002.png" not in before and "000003.png" not in before  # a unit's files appear together or not at all
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # its temporary files are removed
    (out / ".000006.png.1a2b3c.tmp").write_bytes(b"\x89PNG half")  # what a write cut by SIGKILL would leave

    monkeypatch.setattr(generate_module, "write_temporary", write)
    assert main(argv) == 0
    assert folder_pngs(out) == folder_pngs(reference)
    assert all(mtimes(out)[name] == mtime for name, mtime in before.items())  # finished images were not redone
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["already_present"] == len(before) and summary["written"] == NUM_IMAGES - len(before)

    # more images later: images 7 and 8 go on through the list (line 3 at seed FIRST_SEED + 7, line 4's third image)
    assert main(prompts_argv(prompts_file, out, "--num-images", "9")) == 0
    assert {p.name for p in out.glob("*.png")} == PNG_NAMES | {"000007.png", "000008.png"}
    added = [parameters(out / f"00000{k}.png") for k in (7, 8)]
    assert [(found["prompt"], found["seed"]) for found in added] == [("bag", FIRST_SEED + 7), ("ankle boot", 42)]
    assert folder_pngs(out).items() >= folder_pngs(reference).items()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("other-file", "prompts_sha256 'sha256:"),
        ("--first-seed", "first_seed 5 != 6"),
        ("--guidance", "guidance 7.5 != 8.0"),
        ("--negative-prompt", "negative_prompt '' != 'x'"),
        ("--steps", "steps 2 != 3"),
        ("--guidance-interval", "guidance_interval None != [0.5, 1.0]"),
    ],
)
def test_a_rerun_with_other_prompts_or_settings_is_refused(reference, prompts_file, tmp_path, capsys, change, message):
    out = shutil.copytree(reference, tmp_path / "out")
    prompts, extra = prompts_file, []
    if change == "other-file":
        prompts = tmp_path / "other.jsonl"
        prompts.write_text(PROMPTS_JSONL.replace("bag", "shirt"))
    else:
        value = {"--first-seed": "6", "--guidance": "8", "--negative-prompt": "x", "--steps": "3",
                 "--guidance-interval": "0.5 1"}[change]  # fmt: skip
        extra = [change, *value.split()]
    argv = prompts_argv(prompts, out, *extra)  # the last --first-seed counts
    before = mtimes(out)
    assert main(argv) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and message in err[0] and "use the same settings or another --out-dir" in err[0], err
    assert mtimes(out) == before


def test_text_model_without_prompts_and_prompts_for_an_unconditional_model(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["generate", "--model", MODEL, "--out-dir", str(out), "--num-images", "2", "--device", "cpu"]
    assert main(argv) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "is a text-to-image model: give --prompts FILE" in err[0], err
    assert not out.exists()
    assert main(["generate", "--model", MODEL, "--out-dir", str(out)]) == 2
    assert "is a text-to-image model: give --prompts FILE" in capsys.readouterr().err
    assert main(["generate", "--model", "fashion-mnist", "--out-dir", str(out)]) == 2
    assert "give --num-images N (or --prompts FILE" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("bag\n")
    assert main(["generate", "--model", "fashion-mnist", "--prompts", str(prompts), "--out-dir", str(out)]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "fashion-mnist is an unconditional model: --prompts is for text-to-image" in err[0], err
    assert not out.exists()


BAD_FILES = {
    "missing": (None, "no such file"),
    "empty": ("\n  \n", "holds no prompts"),
    "bad-json": ('{"prompt": "bag"}\n\n{"prompt": "bag",}\n', "line 3: not JSON"),
    "not-an-object": ('{"prompt": "bag"}\n["bag"]\n', "line 2: expected a JSON object"),
    "no-prompt": ('{"prompt": "bag"}\n{"seed": 4}\n', 'line 2: "prompt" must be a non-empty string'),
    "empty-prompt": ('{"prompt": "bag"}\n{"prompt": "  "}\n', 'line 2: "prompt" must be a non-empty string'),
    "n-zero": ('{"prompt": "bag", "n": 0}\n', 'line 1: "n" must be a positive integer, got 0'),
    "n-float": ('{"prompt": "bag", "n": 2.0}\n', 'line 1: "n" must be a positive integer, got 2.0'),
    "negative-guidance": ('{"prompt": "bag", "guidance": -1}\n', 'line 1: "guidance" must be a finite number >= 0'),
    "nan-guidance": ('{"prompt": "bag", "guidance": NaN}\n', 'line 1: "guidance" must be a finite number >= 0'),
    "unknown-key": ('{"prompt": "bag", "steps": 4}\n', "line 1: unknown key 'steps' (known: prompt,"),
    "bad-seed": ('{"prompt": "bag", "seed": -1}\n', 'line 1: "seed" must be an integer in 0..'),
    "seed-overflow": ('{"prompt": "bag", "seed": 9223372036854775807, "n": 2}\n', "line 1: seed 9223372036854775807"),
    "bad-negative": ('{"prompt": "bag", "negative_prompt": 3}\n', 'line 1: "negative_prompt" must be a string'),
    "not-utf8": (b"bag\nankle \xff boot\n", "line 2: not UTF-8 text"),
    "mixed-guidance": (
        '{"prompt": "bag"}\n{"prompt": "bag", "guidance": 1}\n',
        "line 2: guidance 1 is unguided (<= 1) but line 1's 7.5 is guided (> 1)",
    ),
    "npz": ("bag\n", "--prompts jobs write PNGs only"),
    "nan-flag": ("bag\n", "--guidance must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_prompts_file_fails_in_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, case):
    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model although the job should have stopped")

    monkeypatch.setattr(generate_module, "load_pipeline", no_loading)
    content, message = BAD_FILES[case]
    prompts = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        prompts.write_bytes(content)
    elif content is not None:
        prompts.write_text(content)
    out = tmp_path / "out"
    extra = {"npz": ["--format", "npz"]}.get(case, [])
    if case == "nan-flag":
        config = generate_module.GenerateConfig(MODEL, None, out, prompts=prompts, guidance=float("nan"))
        with pytest.raises(generate_module.FastdiffError, match=message):
            generate_module.generate(config)
        return
    assert main(prompts_argv(prompts, out, *extra)) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("fastdiff: error: ") and message in err[0], err
    if case not in ("npz",):
        assert f"--prompts {prompts}" in err[0]
    assert not out.exists()


def test_image_list_repeats_and_counts_seeds_per_line():
    lines = [PromptLine(1, "a", "", 7.5, 100, 2), PromptLine(2, "b", "", 7.5, None, 1)]
    job = PromptJob(Path("p"), "sha256:x", lines, num_images=8, first_seed=10)
    assert [(s.prompt, s.seed) for s in job.images(list(range(8)))] == [
        ("a", 100), ("a", 101), ("b", 12), ("a", 102), ("a", 103), ("b", 15), ("a", 104), ("a", 105)
    ]  # fmt: skip
    assert [job.images_of_line(k) for k in range(2)] == [6, 2]


def test_read_prompts_detects_jsonl_by_its_first_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b'\xef\xbb\xbf\n{"prompt": "bag", "n": 3}\n')
    lines, digest = read_prompts(path, 7.5, "")
    assert lines == [PromptLine(2, "bag", "", 7.5, None, 3)] and digest.startswith("sha256:")
    path.write_text("a {json-looking} prompt\n{not json}\n")
    assert [entry.prompt for entry in read_prompts(path, 7.5, "")[0]] == ["a {json-looking} prompt", "{not json}"]


@pytest.mark.slow
def test_torchrun_two_ranks_write_the_same_bytes_as_one_process(reference, prompts_file, tmp_path):
    out = tmp_path / "out"
    done = torchrun("-m", "fastdiff.cli", *prompts_argv(prompts_file, out, "--num-images", str(NUM_IMAGES)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_pngs(out) == folder_pngs(reference)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["images"] for r in summary["ranks"]] == [4, 3]


@pytest.mark.slow
def test_killed_rank_then_torchrun_rerun_finishes_identically(reference, prompts_file, tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "kill_rank_1.py"
    script.write_text(kill_rank_1_script("000002.png", "000003.png"))
    argv = prompts_argv(prompts_file, out, "--num-images", str(NUM_IMAGES))
    killed = torchrun(str(script), *argv)
    assert killed.returncode != 0
    before = mtimes(out)
    assert "000002.png" in before and "000003.png" not in before, killed.stderr[-3000:]
    done = torchrun("-m", "fastdiff.cli", *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_pngs(out) == folder_pngs(reference)
    assert all(mtimes(out)[name] == mtime for name, mtime in before.items())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_prompts_warning_is_logged_once_not_once_a_chunk(tmp_path, caplog):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("zebra bag\n" * 3)
    with caplog.at_level("WARNING"):
        assert main(prompts_argv(prompts, tmp_path / "out", "--batch", "1", "--steps", "1")) == 0
    warnings = [r.getMessage() for r in caplog.records if "zebra" in r.getMessage()]
    assert len(warnings) == 1 and "not in the model's vocabulary" in warnings[0], warnings
