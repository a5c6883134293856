#!/usr/bin/env python
"""llama.cpp decode tokens/s on the GGUF Loom serves, measured the way bench/serving.py measures Loom.

    python bench/llamacpp.py [--gguf PATH] [--new-tokens 64] [--batch 32] [--repeats 3] [--threads N]

Optional: needs ``llama-cpp-python`` (never a Loom dependency; build it for this CPU with
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python``; where the CPU lists AMX but the VM faults on
tile instructions (SIGILL in ``tileloadd``, or a general protection fault in ``libggml-cpu.so``), add
``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` to ``CMAKE_C_FLAGS`` and ``CMAKE_CXX_FLAGS``). Without it
:func:`measure` returns None and bench/serving.py prints one line saying the llama.cpp rows are skipped.

What is measured, matching ``loom_runs`` in bench/serving.py:

- batch 1: one chat request (``chat_prompts(n)[0]``) after a 4-token warm-up on the same prompt; tok/s = generated
  tokens / wall time of the whole request, prefill included; median of ``repeats`` runs. Like Loom's prefix cache,
  llama-cpp-python's ``Llama.generate`` reuses the KV of the prompt prefix it evaluated last, so repeats of the
  same prompt re-evaluate almost none of it on either engine.
- sequential: the ``n`` requests one after another through the same high-level API (it serves one sequence at a
  time), total generated tokens / total wall time; median of ``repeats`` runs.
- batched: the ``n`` requests decoded together through the low-level ``llama_batch`` API, one sequence id (and
  KV stream) each: one ``llama_decode`` for all prompts, then one per step with a token of every sequence; total
  generated tokens / wall time, prefill included; median of ``repeats`` runs. This is what Loom's
  "concurrent" figure compares with.

Every request generates exactly ``new_tokens`` tokens with greedy decoding (end-of-sequence is not a stop, as with
Loom's ``ignore_eos``), on ``n_threads`` threads (for prefill and decode).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import chat_prompts, median

INSTALL_HINT = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'


@dataclass
class LlamaCppResult:
    """Medians in generated tokens/s, and what produced them."""

    batch1: float
    sequential: float  # ``n`` requests one after another (high-level API)
    batched: float  # ``n`` sequences in one llama_batch per step (low-level API)
    n: int
    n_threads: int
    gguf: str
    version: str
    batched_matches: int  # sequences whose batched greedy tokens equal their sequential ones


def loom_threads(tp_size: int = 1) -> int:
    """Threads Loom's CPU workers use in all: per rank ``OMP_NUM_THREADS`` or ``cpu_count // tp_size``, times ranks
    (the rule ``common.worker_threads_rule`` describes)."""
    omp = os.environ.get("OMP_NUM_THREADS")
    per_rank = int(omp) if omp else max(1, (os.cpu_count() or 1) // tp_size)
    return per_rank * tp_size


def prompt_ids(gguf: Path, chats: list[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each chat exactly as Loom's tokenizer process makes them for the converted ``gguf``.

    Loom's ids rather than llama-cpp-python's chat completion: both engines then prefill the very same tokens
    (no difference in template rendering, BOS handling or BPE), and ``Llama.generate`` on ids lets every request
    run to exactly ``new_tokens`` tokens past end-of-sequence, as Loom's ``ignore_eos`` does, which
    ``create_chat_completion`` cannot.
    """
    from ipc.model_source import resolve_model_path
    from tokenizer_proc.text import TextCodec

    codec = TextCodec(resolve_model_path(str(gguf)))
    return [codec.encode_chat(m) for m in chats]


def _generate(llm: Any, ids: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy tokens of one request through the high-level API (prefix KV reuse included)."""
    out: list[int] = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(tok)
        if len(out) == new_tokens:
            break
    return out


def _context(prompt_len: int, new_tokens: int) -> int:
    """Context cells for a prompt and its new tokens, rounded up to llama.cpp's padding of 256."""
    return -(-(prompt_len + new_tokens + 1) // 256) * 256


def _open(llama_cpp: Any, gguf: Path, n_ctx: int, n_threads: int) -> Any:
    """``gguf`` loaded through the high-level API on ``n_threads`` threads (prefill and decode), quietly."""
    return llama_cpp.Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
    )


class BatchOne:
    """llama.cpp loaded once for batch-1 runs taken in turns with Loom's (bench/serving.py pairs them), or None
    from :meth:`load` when llama-cpp-python is not installed."""

    def __init__(self, llm: Any, ids: list[int], new_tokens: int) -> None:
        self.llm, self.ids, self.new_tokens = llm, ids, new_tokens

    @classmethod
    def load(cls, gguf: Path, chat: list[dict[str, str]], new_tokens: int, n_threads: int) -> BatchOne | None:
        """Load ``gguf`` on ``n_threads`` threads; the request is ``chat`` in Loom's token ids (4-token warm-up)."""
        try:
            import llama_cpp
        except ImportError:
            return None
        ids = prompt_ids(gguf, [chat])[0]
        llm = _open(llama_cpp, gguf, _context(len(ids), new_tokens), n_threads)
        _generate(llm, ids, 4)
        return cls(llm, ids, new_tokens)

    def one(self) -> float:
        """Batch-1 tok/s of one request (prefill included, as Loom's)."""
        t = time.perf_counter()
        out = _generate(self.llm, self.ids, self.new_tokens)
        return len(out) / (time.perf_counter() - t)

    def close(self) -> None:
        self.llm.close()


class _Batched:
    """A second context on the same model, holding ``n_seq`` sequences at once, for true batched decoding."""

    def __init__(self, llm: Any, n_seq: int, n_tokens: int, n_batch: int) -> None:
        import llama_cpp

        self.lc = llama_cpp
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_seq_max = n_seq
        params.kv_unified = False  # a KV stream of n_ctx / n_seq cells per sequence: attention reads only its own
        params.n_ctx = n_tokens  # split evenly between the sequences
        params.n_batch = n_batch
        params.n_ubatch = min(512, n_batch)
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed for the batched context")
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))

    def close(self) -> None:
        """Free the batch and the context."""
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence id, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        import numpy as np

        return int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy ``new_tokens`` tokens for every prompt, all sequences in each step's batch."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        self._decode(entries)
        last = [i for i, e in enumerate(entries) if e[3]]
        outs = [[self._argmax(i)] for i in last]
        for step in range(1, new_tokens):
            self._decode(
                [(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs, strict=True))]
            )
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        return outs


def measure(
    gguf: str | Path | None = None,
    *,
    n: int = 32,
    new_tokens: int = 64,
    repeats: int = 3,
    n_threads: int | None = None,
) -> LlamaCppResult | None:
    """llama.cpp batch-1, sequential and batched tok/s on ``gguf`` (default: the embedded SmolLM2 GGUF).

    Returns None when llama-cpp-python is not installed.
    """
    try:
        import llama_cpp
    except ImportError:
        return None
    from ipc.model_source import embedded_gguf_path

    gguf = Path(gguf) if gguf else embedded_gguf_path()
    n_threads = n_threads or loom_threads()
    prompts = prompt_ids(gguf, chat_prompts(n))
    per_seq = _context(max(map(len, prompts)), new_tokens)
    llm = _open(llama_cpp, gguf, per_seq, n_threads)
    _generate(llm, prompts[0], 4)  # warm-up, as loom_runs does

    def timed(fn: Any) -> tuple[float, Any]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    one = []
    for _ in range(repeats):
        dt, out = timed(lambda: _generate(llm, prompts[0], new_tokens))
        one.append(len(out) / dt)
    seq, seq_outs = [], []
    for _ in range(repeats):
        dt, seq_outs = timed(lambda: [_generate(llm, p, new_tokens) for p in prompts])
        seq.append(sum(map(len, seq_outs)) / dt)

    total = sum(map(len, prompts))
    batched = _Batched(llm, n, n_tokens=n * per_seq, n_batch=max(total, n))
    try:
        batched.run(prompts[:1], 4)  # warm-up
        bat, bat_outs = [], []
        for _ in range(repeats):
            dt, bat_outs = timed(lambda: batched.run(prompts, new_tokens))
            bat.append(sum(map(len, bat_outs)) / dt)
    finally:
        batched.close()
    llm.close()
    return LlamaCppResult(
        batch1=median(one),
        sequential=median(seq),
        batched=median(bat),
        n=n,
        n_threads=n_threads,
        gguf=str(gguf),
        version=llama_cpp.__version__,
        batched_matches=sum(a == b for a, b in zip(seq_outs, bat_outs, strict=True)),
    )


def describe(r: LlamaCppResult) -> str:
    """One line: which llama.cpp ran what, and how far batched greedy output agreed with sequential."""
    return (
        f"llama.cpp: llama-cpp-python {r.version}, {Path(r.gguf).name} (its own quantised weights), "
        f"{r.n_threads} threads; batched greedy tokens equal the sequential ones for {r.batched_matches}/{r.n} "
        f"requests (batched kernels round differently)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="default: the threads Loom's CPU worker uses")
    a = p.parse_args()
    r = measure(a.gguf, n=a.batch, new_tokens=a.new_tokens, repeats=a.repeats, n_threads=a.threads)
    if r is None:
        print(f"llama-cpp-python is not installed; to measure llama.cpp: {INSTALL_HINT}")
        return
    print(describe(r))
    print(f"{a.new_tokens} new tokens per request, medians of {a.repeats} runs (tokens/s)")
    print(f"{'batch 1':<34}{r.batch1:>10.1f}")
    print(f"{f'{r.n} sequential (one at a time)':<34}{r.sequential:>10.1f}")
    print(f"{f'{r.n} batched (llama_batch)':<34}{r.batched:>10.1f}")
    print(f"{'batched / batch 1':<34}{r.batched / r.batch1:>10.2f}")


if __name__ == "__main__":
    main()
