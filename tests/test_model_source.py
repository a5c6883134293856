"""GGUF -> Hugging Face conversion (ipc.gguf_convert / ipc.gguf_tokenizer) and its four kinds of error.

Tiny GGUF files are written with ``gguf.GGUFWriter``; the expected weights come from ``gguf``'s own
quantise / dequantise routines and an independent statement of llama.cpp's rotary row order. The real embedded
model is checked against transformers' own GGUF loader (a reference nobody here wrote).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file
from tokenizers.pre_tokenizers import ByteLevel

from ipc import model_source
from ipc.model_config import load_model_config
from ipc.model_source import ModelSourceError, resolve_model_path
from tokenizer_proc.text import TextCodec

REPO = pathlib.Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = sorted(ByteLevel.alphabet())
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + BYTES + ["Ġt", "he", "Ġthe"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 2, 1, 128, 2
HEAD_DIM = HIDDEN // HEADS
# layer 0 keeps q/k exact (F32/F16) to check the rotary row order bit for bit; layer 1 quantises everything
LAYER_TYPES = [
    {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1},
]
FFN_TYPES = {"ffn_gate": Q.BF16, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}


def to_llama_cpp_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's rotary row order: per head, HF row i goes to 2i and row half+i to 2i+1."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        block = w[h * hd : (h + 1) * hd]
        out[h * hd : (h + 1) * hd : 2] = block[: hd // 2]
        out[h * hd + 1 : (h + 1) * hd : 2] = block[hd // 2 :]
    return out


def write_gguf(path, *, arch="llama", tensor_types=None, extra=None, tokenizer_model="gpt2"):
    """A tiny Llama GGUF; returns {gguf name: (hf-order fp32 weight, stored type)}."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    shapes = {"token_embd.weight": ((len(TOKENS), HIDDEN), Q.Q8_0), "output_norm.weight": ((HIDDEN,), Q.F32)}
    for i in range(LAYERS):
        types = {**LAYER_TYPES[i], **FFN_TYPES}
        rows = {"attn_q": HIDDEN, "attn_k": KV_HEADS * HEAD_DIM, "attn_v": KV_HEADS * HEAD_DIM, "attn_output": HIDDEN}
        for mod, n in rows.items():
            shapes[f"blk.{i}.{mod}.weight"] = ((n, HIDDEN), types[mod])
        shapes[f"blk.{i}.ffn_gate.weight"] = ((FFN, HIDDEN), types["ffn_gate"])
        shapes[f"blk.{i}.ffn_up.weight"] = ((FFN, HIDDEN), types["ffn_up"])
        shapes[f"blk.{i}.ffn_down.weight"] = ((HIDDEN, FFN), types["ffn_down"])
        shapes[f"blk.{i}.attn_norm.weight"] = ((HIDDEN,), Q.F32)
        shapes[f"blk.{i}.ffn_norm.weight"] = ((HIDDEN,), Q.F32)
    shapes.update(tensor_types or {})
    made = {}
    for name, (shape, qtype) in shapes.items():
        hf = rng.standard_normal(shape).astype(np.float16).astype(np.float32)  # exact in F16 too
        stored = hf
        if ".attn_q." in name or ".attn_k." in name:
            stored = to_llama_cpp_rows(hf, HEADS if ".attn_q." in name else KV_HEADS)
        if qtype == Q.F32:
            w.add_tensor(name, stored)
        elif qtype == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
        elif qtype in (Q.IQ4_NL, Q.I8):
            nbytes = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor(name, np.zeros(nbytes, np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)
        made[name] = (hf, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made


def leftovers(cache) -> list:
    """Whatever a failed conversion left in the cache (nothing, if it failed cleanly)."""
    return list((cache / "converted").iterdir()) if (cache / "converted").exists() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A converted tiny GGUF: (gguf path, {gguf name: (weight, type)}, converted folder)."""
    d = tmp_path_factory.mktemp("tiny")
    path = d / "tiny.gguf"
    made = write_gguf(path)
    out = d / "converted"
    model_source.convert_gguf(path, out)
    return path, made, out


# ---------------------------------------------------------------------------------------------- conversion


def test_weights_are_gguf_dequantised_in_hf_names_and_rotary_order(tiny):
    path, made, out = tiny
    got = load_file(out / "model.safetensors")
    reader = gguf.GGUFReader(str(path))
    assert len(got) == len(made) and "lm_head.weight" not in got  # tied: no output.weight in the GGUF
    for t in reader.tensors:
        hf, qtype = made[t.name]
        name = model_source_name(t.name)
        assert got[name].dtype == np.float32 and got[name].shape == hf.shape, name
        if qtype in (Q.F32, Q.F16):
            np.testing.assert_array_equal(got[name], hf, err_msg=name)  # exact: checks the row order alone
        want = dequantize(t.data, t.tensor_type).reshape(hf.shape)  # gguf's routine, as stored
        if ".attn_q." in t.name or ".attn_k." in t.name:
            back = to_llama_cpp_rows(got[name], HEADS if ".attn_q." in t.name else KV_HEADS)
            np.testing.assert_array_equal(back, want, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want, err_msg=name)


def model_source_name(gguf_name: str) -> str:
    from ipc.gguf_convert import hf_tensor_name

    return hf_tensor_name(gguf_name)


def test_config_and_tokenizer_files(tiny):
    _, _, out = tiny
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (HIDDEN, LAYERS, HEADS)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (KV_HEADS, HEAD_DIM, FFN)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["rope_theta"]) == (len(TOKENS), 256, 50000.0)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["unk_token_id"]) == (1, 2, 0)
    mc = load_model_config(out)
    assert mc.eos_token_ids == [2] and abs(mc.rms_norm_eps - 1e-5) < 1e-9
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["unk_token"]) == tuple(SPECIALS[i] for i in (1, 2, 0))
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_is_byte_level_bpe_with_special_tokens(tiny):
    codec = TextCodec(tiny[2])
    assert codec.encode(" the") == [TOKENS.index("Ġthe")]
    assert codec.encode("<|im_start|>x<|im_end|>") == [1, TOKENS.index("x"), 2]
    for s in ["héllo wörld 日本 🦙", "  two  spaces\n\ttab", "12345 678", ""]:
        assert codec.decode(codec.encode(s)) == s
    assert codec.decode([1, TOKENS.index("x"), 2]) == "x"  # special tokens dropped
    assert codec.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_conversion_imports_neither_transformers_nor_torch(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path)
    code = (
        "import sys; from ipc.model_source import resolve_model_path; "
        f"print(resolve_model_path({str(path)!r})); "
        "bad = [m for m in ('transformers', 'torch', 'accelerate') if m in sys.modules]; assert not bad, bad"
    )
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (pathlib.Path(r.stdout.strip()) / "model.safetensors").is_file()


def test_converted_folder_is_cached_and_reused(tmp_path, cache, monkeypatch):
    path = tmp_path / "c.gguf"
    write_gguf(path)
    out = resolve_model_path(str(path))
    assert out.parent == cache / "converted"
    assert json.loads((out / "loom_source.json").read_text()) == {"gguf": str(path), "converter": "ipc.gguf_convert"}
    monkeypatch.setattr(model_source, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(str(path)) == out


# ---------------------------------------------------------------------------------------------- the four errors


@pytest.mark.parametrize("module", ["gguf", "tokenizers", "safetensors"])
def test_missing_dependency_names_the_package_and_the_fix(tmp_path, cache, monkeypatch, module):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    for name in [m for m in list(sys.modules) if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    monkeypatch.setitem(sys.modules, module, None)
    for name in ("ipc.gguf_convert", "ipc.gguf_tokenizer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ModelSourceError, match=rf"needs the Python package '{module}', which is not installed") as e:
        resolve_model_path(str(path))
    assert "python3 -m pip install -e ." in str(e.value) and "not a valid GGUF" not in str(e.value)


def test_dependency_too_old_to_import_is_told_apart_from_a_missing_one(tmp_path, cache, monkeypatch):
    path = tmp_path / "old.gguf"
    write_gguf(path)
    monkeypatch.delattr(gguf.quants, "dequantize")  # as in a gguf release without it
    monkeypatch.delitem(sys.modules, "ipc.gguf_convert", raising=False)
    with pytest.raises(ModelSourceError, match=r"needs the Python package 'gguf', whose installed version cannot be"):
        resolve_model_path(str(path))


def test_unreadable_file_says_it_cannot_be_read(tmp_path, cache, monkeypatch):
    path = tmp_path / "locked.gguf"
    write_gguf(path)
    real_open = pathlib.Path.open

    def deny(self, *a, **k):  # chmod 000 does not stop root, so refuse the read the way the OS would
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", deny)
    with pytest.raises(ModelSourceError, match=r"locked\.gguf cannot be read: Permission denied; check") as e:
        resolve_model_path(str(path))
    assert "not a valid GGUF" not in str(e.value)


def test_file_that_is_not_gguf_says_so(tmp_path, cache):
    text = tmp_path / "notes.gguf"
    text.write_text("hello\n")
    with pytest.raises(ModelSourceError, match=r"notes\.gguf is not a valid GGUF file: it starts with b'hell'"):
        resolve_model_path(str(text))
    truncated = tmp_path / "cut.gguf"
    write_gguf(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(ModelSourceError, match=r"cut\.gguf: not a valid GGUF file \(truncated or corrupt: "):
        resolve_model_path(str(truncated))
    assert leftovers(cache) == []


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.I8])
def test_unsupported_quantisation_names_the_tensor_type_and_the_fix(tmp_path, cache, qtype):
    path = tmp_path / "iq.gguf"
    write_gguf(path, tensor_types={"blk.1.ffn_up.weight": ((FFN, HIDDEN), qtype)})
    with pytest.raises(ModelSourceError, match=rf"blk\.1\.ffn_up\.weight is quantised as {qtype.name}") as e:
        resolve_model_path(str(path))
    assert "supported: F32, F16, BF16, Q4_0, Q4_1" in str(e.value) and "re-quantise" in str(e.value)
    assert leftovers(cache) == []  # refused before anything is written


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path, cache):
    path = tmp_path / "g.gguf"
    write_gguf(path, arch="gpt2")
    with pytest.raises(ModelSourceError, match=r"general\.architecture='gpt2' is not supported \(only 'llama'\)"):
        resolve_model_path(str(path))
    path = tmp_path / "spm.gguf"
    write_gguf(path, tokenizer_model="llama")
    with pytest.raises(ModelSourceError, match=r"tokenizer\.ggml\.model='llama' is not supported"):
        resolve_model_path(str(path))
    path = tmp_path / "extra.gguf"
    write_gguf(path, tensor_types={"blk.0.attn_q.bias": ((HIDDEN,), Q.F32)})
    with pytest.raises(ModelSourceError, match=r"tensor blk\.0\.attn_q\.bias has no counterpart in a Llama"):
        resolve_model_path(str(path))


# ---------------------------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_embedded_model_matches_transformers_gguf_loader(model_path, text_codec):
    """Every tensor bit-equal to transformers' own GGUF dequantisation; tokens equal to its GGUF tokenizer."""
    pytest.importorskip("accelerate")  # transformers 5 needs it to load a GGUF
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_source.embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    want = {k: v.numpy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    got = load_file(model_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    del ref, want
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    texts = [
        "The capital of France is",
        "x  2024   y",
        "naïve café 日本語 🦙👍🏽",
        "def f(x):\n    return x**2\n",
        "\t\r\n  ",
    ]
    texts += ["<|im_start|>user\nHi<|im_end|>", "3.14159 -42 0x1F", "I'm don't we'll", "a" * 200]
    for s in texts:
        assert text_codec.encode(s) == tok(s, add_special_tokens=False)["input_ids"], s
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert text_codec.render_chat(messages) == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
