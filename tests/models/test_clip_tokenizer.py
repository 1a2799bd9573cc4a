"""fastdiff's CLIP tokenizer against transformers' ``CLIPTokenizer`` read from the same folder: the bundled model's
(whole words), the test fixtures' byte-level ones (SD 1.5 pads with the end token, SD 2.1 with "!") and a merges
vocabulary written as SD's (vocab.json + merges.txt + an AddedToken tokenizer_config.json); on prompts with case,
white space, punctuation, digits, contractions, accents, emoji and CJK, typed special tokens, empty and over-long
prompts. Every call fastdiff and diffusers make gives the same ids, masks, tokens and text."""

from __future__ import annotations

import json

import pytest
import torch
from sd_fixtures import write_tiny_clip_tokenizer

from fastdiff.errors import FastdiffError
from fastdiff.models.clip_tokenizer import CLIPTokenizer, to_transformers
from fastdiff.models.stable_diffusion import BUNDLED_PIPELINES, byte_alphabet

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "a photo of an ankle boot",
    "A Photo of  a\tBAG,\n\nproduct   photo!!",
    "it's a t-shirt; they've 2 pullovers (3.5 cm) & 1000 coats...",
    "Crème brûlée naïve café — Ünïcödé",
    "a sneaker 👟 on the moon 月 and 日本語",
    "<|startoftext|> typed <|endoftext|> tokens",
    "",
    "   ",
    " ".join(["a very long prompt about a dress"] * 20),
]


def sd_style_folder(tmp_path):
    """vocab.json / merges.txt of the byte alphabet and a few merges, special tokens as AddedToken dicts in
    tokenizer_config.json (as SD 1.5's folder has them), SD 2.1's "!" padding."""
    alphabet = byte_alphabet()
    merges = [("p", "h"), ("ph", "o"), ("t", "o</w>"), ("pho", "to</w>"), ("a", "n"), ("an", "k"), ("l", "e</w>")]
    tokens = (
        alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in merges] + ["<|startoftext|>", "<|endoftext|>"]
    )
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
                "single_word": False}  # fmt: skip

    config = {"add_prefix_space": False, "bos_token": added("<|startoftext|>"), "do_lower_case": True,
              "eos_token": added("<|endoftext|>"), "errors": "replace", "model_max_length": 77, "pad_token": "!",
              "tokenizer_class": "CLIPTokenizer", "unk_token": added("<|endoftext|>")}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(params=["bundled", "tiny-sd15", "tiny-sd21", "sd-style", "sd21-hub-style"])
def folder(request, tmp_path):
    if request.param == "bundled":
        return BUNDLED_PIPELINES["fashion-mnist-t2i"] / "tokenizer"
    if request.param == "sd-style":
        return sd_style_folder(tmp_path)
    if request.param == "sd21-hub-style":  # SD 2.x: the config pads with the end token, the map with "!" (it wins)
        folder = sd_style_folder(tmp_path)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|endoftext|>"}))
        special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        (folder / "special_tokens_map.json").write_text(json.dumps({**special, "pad_token": "!"}))
        return folder
    write_tiny_clip_tokenizer(tmp_path, pad_token="<|endoftext|>" if request.param == "tiny-sd15" else "!")
    return tmp_path


def test_same_ids_masks_tokens_and_text_as_transformers(folder):
    ours = CLIPTokenizer.from_pretrained(folder)
    theirs = transformers.CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "pad_token", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == sorted(set(theirs.all_special_ids))
    assert ours.num_special_tokens_to_add() == theirs.num_special_tokens_to_add()

    # encode_prompts' and diffusers' encode_prompt's call
    kw = dict(padding="max_length", max_length=ours.model_max_length, truncation=True, return_tensors="pt")
    got, want = ours(PROMPTS, **kw), theirs(PROMPTS, **kw)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.attention_mask, want.attention_mask)
    assert got.input_ids.shape == (len(PROMPTS), 77) and got.attention_mask[-1].all()  # the long one: truncated
    for padding, truncation in [("do_not_pad", "do_not_truncate"), ("longest", "longest_first"), (True, True)]:
        kw = dict(padding=padding, truncation=truncation, max_length=10)
        assert ours(PROMPTS[:3], **kw).input_ids == theirs(PROMPTS[:3], **kw).input_ids, (padding, truncation)
    # prompt_warnings' call: no special tokens, no truncation; and diffusers' truncation check (padding="longest")
    assert ours(PROMPTS, add_special_tokens=False).input_ids == theirs(PROMPTS, add_special_tokens=False).input_ids
    longest = dict(padding="longest", return_tensors="pt")
    got, want = ours(PROMPTS, **longest), theirs(PROMPTS, **longest)
    assert torch.equal(got.input_ids, want.input_ids)
    for ids in ours(PROMPTS, add_special_tokens=False).input_ids + [[ours.bos_token_id, *range(5), ours.eos_token_id]]:
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(7) == theirs.convert_ids_to_tokens(7)
    assert [ours.tokenize(p) for p in PROMPTS] == [theirs.tokenize(p) for p in PROMPTS]


def test_save_and_transformers_copy_round_trip(folder, tmp_path):
    ours = CLIPTokenizer.from_pretrained(folder)
    ours.save_pretrained(tmp_path / "saved")
    again = CLIPTokenizer.from_pretrained(tmp_path / "saved")
    from_json = tmp_path / "json-only"  # a folder with tokenizer.json alone
    from_json.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (from_json / name).write_bytes((tmp_path / "saved" / name).read_bytes())
    saved = json.loads((from_json / "tokenizer.json").read_text())  # a file that pads and truncates on its own
    saved["padding"] = {"strategy": {"Fixed": 5}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "!"}  # fmt: skip
    saved["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (from_json / "tokenizer.json").write_text(json.dumps(saved))
    assert (tmp_path / "saved" / "vocab.json").is_file() == (folder / "vocab.json").is_file()
    theirs = to_transformers(ours)
    kw = dict(padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    want = ours(PROMPTS, **kw).input_ids
    assert torch.equal(again(PROMPTS, **kw).input_ids, want) and torch.equal(theirs(PROMPTS, **kw).input_ids, want)
    assert torch.equal(CLIPTokenizer.from_pretrained(from_json)(PROMPTS, **kw).input_ids, want)
    slow = transformers.CLIPTokenizer.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    assert torch.equal(slow(PROMPTS, **kw).input_ids, want)
    assert again.pad_token_id == theirs.pad_token_id == ours.pad_token_id


def test_bad_folders_are_one_line_errors(tmp_path):
    with pytest.raises(FastdiffError, match="tokenizer files missing"):
        CLIPTokenizer.from_pretrained(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "a</w>": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(FastdiffError, match=r"merges.txt:2: a merge is two tokens"):
        CLIPTokenizer.from_pretrained(tmp_path)
