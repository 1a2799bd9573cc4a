"""Prompts a model cannot know: one short warning line per problem (words out of the model's vocabulary, a prompt
longer than its 77 tokens), logged by ``encode_prompts`` and kept in ``TextToImagePipeline.last_prompt_warnings``;
nothing else on stderr; the truncation itself unchanged."""

from __future__ import annotations

import logging

import pytest
import torch
from sd_fixtures import write_tiny_clip_tokenizer

from fastdiff.cli import main
from fastdiff.models.clip_tokenizer import CLIPTokenizer
from fastdiff.models.stable_diffusion import encode_prompts, is_spelled_out, knows_words, prompt_warnings
from fastdiff.pipelines.text_to_image import TextToImagePipeline

LOGGER = "fastdiff.models.stable_diffusion"
CLASS_WORDS = ["dress", "coat", "sneaker", "bag", "shirt", "sandal", "trousers", "pullover", "ankle", "boot"]
LONG_PROMPT = " ".join(CLASS_WORDS[i % len(CLASS_WORDS)] for i in range(200))
"""200 words the bundled tokenizer knows whole (one token each): 125 beyond its 75 content tokens."""
UNKNOWN_WORDS = "3 of the prompt's words are not in the model's vocabulary (first few: red, sports, car)"
TOO_LONG = (
    "the prompt is longer than the model's 77 tokens and is truncated: 125 tokens dropped "
    "(first few words dropped: sandal trousers pullover ankle boot)"
)


@pytest.fixture(scope="module")
def bundled():
    """The bundled Fashion-MNIST text-to-image model, one step (32x32)."""
    return TextToImagePipeline.from_pretrained("fashion-mnist-t2i", device="cpu", steps=1)


def warning_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def run(pipe, caplog, prompt, **kwargs) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pipe(prompt, progress=False, output_type="pt", **kwargs)
    return warning_lines(caplog)


def test_unknown_words_warn_once_in_one_line(bundled, caplog):
    lines = run(bundled, caplog, "a red sports car")
    assert lines == [UNKNOWN_WORDS]
    assert bundled.last_prompt_warnings == [UNKNOWN_WORDS]


def test_class_prompts_do_not_warn_and_the_warnings_are_per_call(bundled, caplog):
    run(bundled, caplog, "a red sports car")
    assert run(bundled, caplog, "a photo of a dress") == [] and bundled.last_prompt_warnings == []
    tokenizer = bundled.components.tokenizer
    for prompt in ("sneakers", "an ankle boot, product photo", "A Photo Of A T-Shirt", "tshirts!", "3 bags"):
        assert prompt_warnings(tokenizer, [prompt]) == []


def test_an_over_long_prompt_gives_one_short_line_and_no_transformers_warning(bundled, caplog, capfd):
    capfd.readouterr()
    lines = run(bundled, caplog, LONG_PROMPT, guidance_scale=3.0)  # with "" as the negative prompt
    assert lines == [TOO_LONG] and bundled.last_prompt_warnings == [TOO_LONG]
    assert "Token indices" not in "".join(capfd.readouterr())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [TOO_LONG]


def test_an_over_long_prompt_encodes_as_its_first_77_tokens(bundled, caplog):
    parts = bundled.components
    kept = " ".join(LONG_PROMPT.split()[:75])
    assert len(parts.tokenizer(kept).input_ids) == 77
    with caplog.at_level(logging.WARNING):
        long, short = (encode_prompts(parts.text_encoder, parts.tokenizer, [p], "cpu") for p in (LONG_PROMPT, kept))
    assert torch.equal(long, short)
    assert warning_lines(caplog) == [TOO_LONG]


def test_both_problems_and_several_prompts_name_their_prompt(bundled, caplog):
    parts = bundled.components
    warnings: list[str] = []
    with caplog.at_level(logging.WARNING):
        encode_prompts(parts.text_encoder, parts.tokenizer, ["a dress", "a red dress", ""], "cpu", warnings)
    assert warnings == [
        "prompt 'a red dress': 1 of the prompt's words is not in the model's vocabulary (first few: red)"
    ]
    assert warning_lines(caplog) == warnings
    both = prompt_warnings(parts.tokenizer, ["a red sports car " + LONG_PROMPT])
    assert len(both) == 2 and both[0] == UNKNOWN_WORDS and both[1].startswith("the prompt is longer than the model's")


def test_negative_prompt_and_prompt_words_are_checked(bundled, caplog):
    """Several prompts: each line names its prompt (the negative one here)."""
    lines = run(bundled, caplog, ["a dress", "a bag"], negative_prompt="blurry", guidance_scale=3.0)
    assert lines == ["prompt 'blurry': 1 of the prompt's words is not in the model's vocabulary (first few: blurry)"]


@pytest.mark.parametrize("library", ["fastdiff", "transformers"])
@pytest.mark.parametrize("pad", ["<|endoftext|>", "!"], ids=["sd15", "sd21"])
def test_byte_level_sd_tokenizers_warn_only_of_length(pad, library, tmp_path):
    """The tiny SD fixtures' tokenizers (byte-level, a few merges, as fastdiff's random presets) spell every word in
    bytes: no vocabulary to check, so ordinary prompts do not warn; a long one still does. The same lines with
    transformers' tokenizer of the same files."""
    write_tiny_clip_tokenizer(tmp_path, pad_token=pad)
    if library == "transformers":
        tokenizer = pytest.importorskip("transformers").CLIPTokenizer.from_pretrained(str(tmp_path))
    else:
        tokenizer = CLIPTokenizer.from_pretrained(tmp_path)
    assert not knows_words(tokenizer)
    for prompt in ("a cat on the mat", "a photo of a dress", "ein Bild, 猫", "a red sports car, 4k, highly detailed"):
        assert prompt_warnings(tokenizer, [prompt]) == []
    (line,) = prompt_warnings(tokenizer, ["a photo of a dress " * 20])
    assert line.startswith("the prompt is longer than the model's 77 tokens and is truncated: ")
    assert line.endswith("185 tokens dropped (first few words dropped: …ess a photo of a)")


def test_the_unknown_word_rule():
    """Known: one token, or learnt sub-words (as a real CLIP vocabulary splits rare words); unknown: mostly single
    bytes (what a word the tokenizer never saw becomes)."""
    assert not is_spelled_out(["dress</w>"])
    assert not is_spelled_out(["bio", "lumin", "escent</w>"])
    assert not is_spelled_out(["tshirt", "s</w>"])
    assert is_spelled_out(["r", "e", "d</w>"])
    assert is_spelled_out(["s", "p", "o", "r", "ts</w>"])
    assert is_spelled_out(["ç", "Į", "«</w>"])


def test_cli_logs_one_line_per_problem(tmp_path, caplog):
    """``fastdiff sample``: a line for the unknown words, one for the length (the CLI's format: one line each)."""
    out = tmp_path / "grid.png"
    with caplog.at_level(logging.WARNING):
        rc = main(["sample", "--model", "fashion-mnist-t2i", "--prompt", f"a red sports car {LONG_PROMPT}", "--steps",
                   "1", "--batch", "1", "--device", "cpu", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0 and out.is_file()
    lines = warning_lines(caplog)
    assert [line.split(":")[0] for line in lines] == [UNKNOWN_WORDS.split(":")[0], TOO_LONG.split(":")[0]]
    assert lines[0] == UNKNOWN_WORDS and all("\n" not in line and len(line) < 160 for line in lines)
    assert not any("Token indices" in r.getMessage() for r in caplog.records)
