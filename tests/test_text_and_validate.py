"""Tokenizer-side logic: TextCodec (vs transformers' tokenizer and chat template), streaming text, validation."""

from __future__ import annotations

import pytest
from loom_helpers import PROMPTS

from ipc.messages import ChatMessage, GenerateReq, SamplingParams
from tokenizer_proc.text import ChatTemplateError, IncrementalText, TextCodec
from tokenizer_proc.validate import (
    BadRequest,
    check_one_prompt,
    check_prompt_chars,
    validate_prompt_ids,
    validate_sampling,
)


@pytest.mark.slow  # needs the transformers reference (computed once, ~40 s, then cached)
@pytest.mark.parametrize("name", [p.name for p in PROMPTS])
def test_loom_tokenization_matches_transformers(name, prompts_ids, loom_prompt_ids):
    """Loom's tokenizers+jinja path gives the same ids as transformers (tokenizer and apply_chat_template)."""
    assert loom_prompt_ids[name] == prompts_ids[name]


def test_prompt_lengths_cover_short_and_long(loom_prompt_ids):
    lens = {p.name: len(loom_prompt_ids[p.name]) for p in PROMPTS}
    assert sum(n > 200 for n in lens.values()) >= 2 and sum(n < 50 for n in lens.values()) >= 3, lens
    assert any(p.messages for p in PROMPTS) and any(p.text for p in PROMPTS)


def test_chat_template_adds_default_system_prompt_and_generation_prompt(text_codec):
    s = text_codec.render_chat([{"role": "user", "content": "Hi"}])
    assert s.startswith("<|im_start|>system\n") and "SmolLM" in s
    assert s.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    s = text_codec.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert s.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in s


def test_special_tokens_in_text_are_recognised(text_codec):
    assert text_codec.encode("<|im_end|>") == [2]
    assert text_codec.decode([504, 3575, 2]) == "The capital"  # specials dropped on decode


def test_encode_decode_round_trip(text_codec):
    for s in ["Hello, world!", "  leading spaces", "naïve café — ünïcödé ✓ 日本語", "tabs\tand\nnewlines", "🙂🚀"]:
        assert text_codec.decode(text_codec.encode(s)) == s


def test_no_chat_template_is_a_clear_error(tmp_path, model_path):
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((model_path / f).read_bytes())
    codec = TextCodec(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        codec.render_chat([{"role": "user", "content": "x"}])


def test_template_errors_become_chat_template_errors(text_codec):
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        text_codec.render_chat([{"role": "user"}])  # no content


def test_incremental_text_never_shows_half_a_character(text_codec):
    ids = text_codec.encode("Rocket 🚀 launch 日本")
    inc = IncrementalText(text_codec)
    shown = []
    for i, t in enumerate(ids):
        shown.append(inc.push([t], final=i == len(ids) - 1))
    assert all("\ufffd" not in s for s in shown)
    assert all(a == b[: len(a)] for a, b in zip(shown, shown[1:], strict=False))  # only ever grows
    assert shown[-1] == "Rocket 🚀 launch 日本"


def gen_req(**sp) -> GenerateReq:
    return GenerateReq(text="hi", sampling_params=SamplingParams(**sp))


@pytest.mark.parametrize(
    ("sp", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 5000}, "max_new_tokens=5000"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": 1e9}, "temperature=1000000000.0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": float("inf")}, "temperature=inf"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_p": -0.1}, "top_p=-0.1"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_k": 1000}, "top_k=1000"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 300}, "stop"),
        ({"stop_token_ids": [5, 100, -1]}, "[100, -1]"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**63}, "seed="),
    ],
)
def test_validate_sampling_refuses_out_of_range_values(sp, needle):
    with pytest.raises(BadRequest) as e:
        validate_sampling(gen_req(**sp), context_len=4096, vocab_size=100)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "sp",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 100.0, "top_p": 1.0, "top_k": 100},
        {"top_p": 1e-9, "top_k": 1},
        {"max_new_tokens": 4096},
        {"stop": ["a", "b"], "stop_token_ids": [0, 99], "seed": 0},
        {"seed": 2**63 - 1},
    ],
)
def test_validate_sampling_accepts_edge_values(sp):
    validate_sampling(gen_req(**sp), context_len=4096, vocab_size=100)


def test_validate_prompt_ids():
    validate_prompt_ids([0, 99], 10, 12, 100)
    with pytest.raises(BadRequest, match="empty"):
        validate_prompt_ids([], 1, 10, 100)
    with pytest.raises(BadRequest, match=r"input_ids\[1\]=100 is outside the vocabulary \[0, 100\)"):
        validate_prompt_ids([1, 100], 1, 10, 100)
    with pytest.raises(BadRequest, match=r"input_ids\[0\]=-1"):
        validate_prompt_ids([-1], 1, 10, 100)
    with pytest.raises(BadRequest, match=r"prompt \(3 tokens\) \+ max_new_tokens \(8\) exceeds the context length 10"):
        validate_prompt_ids([1, 2, 3], 8, 10, 100)


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (GenerateReq(), "got none"),
        (GenerateReq(text="a", input_ids=[1]), "['text', 'input_ids']"),
        (GenerateReq(text="a", messages=[ChatMessage("user", "b")]), "messages"),
        (GenerateReq(text=""), "empty"),
        (GenerateReq(messages=[]), "messages is empty"),
        (GenerateReq(messages=[ChatMessage("user", "a"), ChatMessage("robot", "b")]), "messages[1].role='robot'"),
        (GenerateReq(text="a", lora_path=""), "lora_path must be a non-empty adapter name"),
        (GenerateReq(text="a", allow_special_tokens_in_content=True), "applies to messages only"),
        (GenerateReq(input_ids=[1], allow_special_tokens_in_content=True), "applies to messages only"),
    ],
)
def test_check_one_prompt(req, needle):
    with pytest.raises(BadRequest) as e:
        check_one_prompt(req)
    assert needle in str(e.value)


def test_check_one_prompt_accepts_every_chat_role():
    roles = ["system", "user", "assistant", "tool"]
    check_one_prompt(GenerateReq(messages=[ChatMessage(r, "x") for r in roles], lora_path="adapter"))


def test_check_prompt_chars():
    check_prompt_chars("the text", 90, max_new_tokens=1, context_len=10, max_token_chars=10)
    with pytest.raises(BadRequest, match=r"text is 91 characters, longer than the 90 characters"):
        check_prompt_chars("the text", 91, max_new_tokens=1, context_len=10, max_token_chars=10)
    # max_new_tokens that takes the whole context: the message says that, not "longer than the 0 characters"
    # (no doubled article: the caller's name of the prompt carries its own, "the rendered chat" included)
    with pytest.raises(BadRequest, match=r"max_tokens \(10\) leaves no room for the text in the context length 10: "):
        kw = {"max_new_tokens": 10, "context_len": 10, "max_token_chars": 10, "limit_name": "max_tokens"}
        check_prompt_chars("the text", 2, **kw)
    with pytest.raises(BadRequest, match=r"leaves no room for the messages' content in the context length 10"):
        check_prompt_chars("the messages' content", 2, max_new_tokens=10, context_len=10, max_token_chars=10)


def test_longest_token_chars_bounds_every_token(text_codec):
    n = text_codec.tok.get_vocab_size(with_added_tokens=True)
    assert all(len(text_codec.decode([i])) <= text_codec.max_token_chars for i in range(0, n, 97))
