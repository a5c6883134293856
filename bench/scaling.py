#!/usr/bin/env python
"""Cost that grows with the work: Loom tokens/s against concurrency and against context length (one cluster).

    python bench/scaling.py [--concurrency 1,8,32,64] [--contexts 256,1024,4096] [--context-concurrency 1]
                            [--prompt-tokens 128] [--new-tokens 32] [--dtype bfloat16] [--tp-size 1]
                            [--max-kv-tokens 65536] [--repeats 1]

Every request is streamed, prompts are seeded random token ids of an exact length (distinct per request) and
every request generates exactly ``--new-tokens`` tokens (``ignore_eos``). A row sends its requests all at once.

- Concurrency rows: ``c`` requests of ``--prompt-tokens`` prompt tokens each, for each ``c`` of
  ``--concurrency``. Columns: total tokens/s (completion tokens / wall), its ratio to the first row and that
  ratio over ``c`` (1.00 = perfect batching), time to first token (p50, max) and each request's decode
  tokens/s after its first token (p50).
- Context rows: prompts of ``L`` tokens for each ``L`` of ``--contexts``, at each concurrency of
  ``--context-concurrency``. Columns as above plus prefill ms per prompt token and the ratios of TTFT and
  per-request decode tok/s to the first row of that concurrency next to the context ratio: TTFT growing faster
  than the context (ms per prompt token rising) is the quadratic attention step; decode tok/s falling with
  the context is attention reading the longer KV cache every token.
- Every row also shows completion tokens per CPU-second of the gpu_worker processes, the cores they kept busy
  and the load average after the row: on a shared machine tok/s falls when other processes take the CPU, tokens
  per worker CPU-second much less so.

The cluster's KV pool (``--max-total-tokens``) is sized for the largest row, capped at ``--max-kv-tokens``: a
row that would need more runs at the concurrency the cap holds, and the output says so. Prompts longer than
the model's ``max_position_embeddings`` minus ``--new-tokens`` are skipped with a note. On a 2-core CPU a
4,096-token prefill takes seconds, so the default runs context rows at concurrency 1; on a GPU try
``--context-concurrency 1,8,64 --max-kv-tokens 300000``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from common import (
    Cluster,
    add_quantization_arg,
    bench_header,
    loadavg,
    loom_cluster,
    median,
    quantile,
    random_prompt_ids,
)


@dataclass
class Req:
    """One streamed request: seconds to its first token and to its end, and its completion tokens."""

    ttft: float
    e2e: float
    tokens: int

    @property
    def decode_tps(self) -> float:
        """Tokens/s after the first token (nan for a one-token request)."""
        return (self.tokens - 1) / (self.e2e - self.ttft) if self.tokens > 1 and self.e2e > self.ttft else float("nan")


@dataclass
class Row:
    """Measured waves of one row (``conc`` requests of ``prompt`` tokens each)."""

    prompt: int
    conc: int
    waves: list[tuple[float, list[Req]]]  # (wall seconds, requests)
    cpu: float  # CPU seconds of the gpu_worker processes over the waves
    load: str  # the machine's load average after the row
    note: str = ""
    asked: int = 0  # the concurrency asked for (``conc`` is less where the KV pool could not hold it)

    @property
    def cores(self) -> float:
        """Cores the workers kept busy (below their thread count: waiting, or other processes took the CPU)."""
        return self.cpu / sum(w for w, _ in self.waves)

    @property
    def tok_per_cpu(self) -> float:
        """Completion tokens per worker CPU-second: less sensitive to other load on the machine than tok/s."""
        return sum(r.tokens for r in self.reqs()) / self.cpu if self.cpu else float("nan")

    @property
    def tps(self) -> float:
        return median([sum(r.tokens for r in reqs) / wall for wall, reqs in self.waves])

    @property
    def wall(self) -> float:
        return median([w for w, _ in self.waves])

    def reqs(self) -> list[Req]:
        return [r for _, reqs in self.waves for r in reqs]

    @property
    def ttft_p50(self) -> float:
        return quantile([r.ttft for r in self.reqs()], 0.5)

    @property
    def ttft_max(self) -> float:
        return max(r.ttft for r in self.reqs())

    @property
    def decode_p50(self) -> float:
        return quantile([r.decode_tps for r in self.reqs() if r.decode_tps == r.decode_tps], 0.5)


async def wave(endpoint: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Req]]:
    """Stream every prompt at once; (wall seconds, per-request timings)."""
    from ipc.client import AsyncLoomClient

    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def one(client: AsyncLoomClient, ids: list[int], t0: float) -> Req:
        first = None
        n = 0
        async for chunk in client.generate_stream(input_ids=ids, sampling_params=sp):
            n = len(chunk["output_ids"])
            if first is None and n:
                first = time.perf_counter() - t0
        end = time.perf_counter() - t0
        return Req(end if first is None else first, end, n)

    async with AsyncLoomClient(endpoint) as c:
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*[one(c, ids, t0) for ids in prompts])
        return time.perf_counter() - t0, list(reqs)


def run_row(cluster: Cluster, prompt: int, conc: int, new_tokens: int, vocab: int, repeats: int, seed: int) -> Row:
    """``repeats`` waves of ``conc`` requests with ``prompt``-token prompts (fresh prompts every wave)."""
    waves = []
    cpu0 = cluster.worker_cpu_s()
    for r in range(repeats):
        base = seed * 1_000_000 + prompt * 1_000 + conc * 10 + r
        prompts = [random_prompt_ids(prompt, vocab, base * 100 + i) for i in range(conc)]
        waves.append(asyncio.run(wave(cluster.endpoint, prompts, new_tokens)))
    return Row(prompt, conc, waves, cluster.worker_cpu_s() - cpu0, loadavg())


def ints(s: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``."""
    return [int(x) for x in s.split(",") if x.strip()]


Plan = tuple[int, int, str, int]  # (prompt tokens, concurrency, note, concurrency asked for)


def plan_rows(a: argparse.Namespace, max_pos: int) -> tuple[list[Plan], list[Plan]]:
    """(concurrency rows, context rows), each row's concurrency fitted to ``--max-kv-tokens``."""

    def fit(prompt: int, conc: int) -> Plan:
        need = conc * (prompt + a.new_tokens)
        if need <= a.max_kv_tokens:
            return prompt, conc, "", conc
        c = max(1, a.max_kv_tokens // (prompt + a.new_tokens))
        note = f"concurrency {conc} -> {c}: {need} KV tokens needed, --max-kv-tokens {a.max_kv_tokens}"
        return prompt, c, note, conc

    conc_rows = [fit(a.prompt_tokens, c) for c in ints(a.concurrency)]
    contexts = []
    for L in ints(a.contexts):
        if L + a.new_tokens > max_pos:
            print(f"note: context {L} skipped: {L} + {a.new_tokens} new tokens > max_position_embeddings {max_pos}")
        else:
            contexts.append(L)
    return conc_rows, [fit(L, c) for c in ints(a.context_concurrency) for L in contexts]


def print_concurrency(rows: list[Row], new_tokens: int) -> None:
    print(f"\nconcurrency: {rows[0].prompt}-token prompts, {new_tokens} new tokens each, all sent at once")
    print(
        f"{'conc':>5}{'wall s':>9}{'tok/s':>9}{'x row 1':>9}{'/ conc':>8}{'TTFT p50':>10}{'TTFT max':>10}"
        f"{'dec tok/s/req':>15}{'tok/cpu-s':>11}{'cores':>7}{'load':>6}  note"
    )
    r0 = rows[0]
    for r in rows:
        x = r.tps / r0.tps
        print(
            f"{r.conc:>5}{r.wall:>9.2f}{r.tps:>9.1f}{x:>9.2f}{x * r0.conc / r.conc:>8.2f}{r.ttft_p50:>10.3f}"
            f"{r.ttft_max:>10.3f}{r.decode_p50:>15.1f}{r.tok_per_cpu:>11.1f}{r.cores:>7.2f}{r.load:>6}  {r.note}"
        )


def print_context(rows: list[Row], new_tokens: int) -> None:
    print(f"\ncontext: prompts of L tokens, {new_tokens} new tokens each; ratios against the first row of each conc")
    print(
        f"{'L':>6}{'conc':>5}{'wall s':>9}{'tok/s':>9}{'TTFT p50':>10}{'ms/prompt tok':>15}{'dec tok/s/req':>15}"
        f"{'L x':>7}{'TTFT x':>8}{'dec x':>7}{'tok/cpu-s':>11}{'cores':>7}{'load':>6}  note"
    )
    first: dict[int, Row] = {}
    for r in rows:
        r0 = first.setdefault(r.asked, r)
        ms_tok = r.ttft_p50 * 1000 / r.prompt / max(1, r.conc)  # all prompts of a row prefill together
        print(
            f"{r.prompt:>6}{r.conc:>5}{r.wall:>9.2f}{r.tps:>9.1f}{r.ttft_p50:>10.3f}{ms_tok:>15.3f}"
            f"{r.decode_p50:>15.1f}{r.prompt / r0.prompt:>7.1f}{r.ttft_p50 / r0.ttft_p50:>8.2f}"
            f"{r.decode_p50 / r0.decode_p50:>7.2f}{r.tok_per_cpu:>11.1f}{r.cores:>7.2f}{r.load:>6}  {r.note}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,64", help="concurrency rows (comma-separated)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the concurrency rows")
    p.add_argument("--contexts", default="256,1024,4096", help="prompt lengths of the context rows")
    p.add_argument("--context-concurrency", default="1", help="concurrencies of the context rows")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    add_quantization_arg(p)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--max-kv-tokens", type=int, default=65536, help="largest KV pool to start the cluster with")
    p.add_argument("--repeats", type=int, default=1, help="waves per row (medians)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from ipc.model_config import load_model_config
    from ipc.model_source import resolve_model_path

    cfg = load_model_config(resolve_model_path(None))
    conc_rows, ctx_rows = plan_rows(a, cfg.max_position_embeddings)
    if not conc_rows + ctx_rows:
        p.error("nothing to run: give --concurrency and/or --contexts")
    need = max(c * (n + a.new_tokens) for n, c, _, _ in conc_rows + ctx_rows)
    kv_tokens = max(need, max(n for n, _, _, _ in conc_rows + ctx_rows) + a.new_tokens)
    item = {"float32": 4, "auto": 4}.get(a.dtype, 2)
    kv_gib = kv_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item / 2**30
    print(
        bench_header(
            "bench/scaling.py: tokens/s against concurrency and context",
            dtype=a.dtype,
            tp_size=a.tp_size,
            extra=f"Loom --quantization {a.quantization}; model max context {cfg.max_position_embeddings} "
            "(max_position_embeddings); KV pool "
            f"--max-total-tokens {kv_tokens} ({kv_gib:.2f} GiB), context length = min(model, pool)",
        ),
        flush=True,
    )
    flags = ["--dtype", a.dtype, "--quantization", a.quantization, "--tp-size", str(a.tp_size)]
    flags += ["--max-total-tokens", str(kv_tokens)]
    flags += ["--max-running-requests", str(max(64, max(c for _, c, _, _ in conc_rows + ctx_rows)))]
    with loom_cluster(*flags) as cluster:
        asyncio.run(wave(cluster.endpoint, [random_prompt_ids(16, cfg.vocab_size, -1)], 4))  # warm-up
        rows = []
        for n, c, note, asked in conc_rows + ctx_rows:
            r = run_row(cluster, n, c, a.new_tokens, cfg.vocab_size, a.repeats, a.seed)
            r.note, r.asked = note, asked
            print(f"  L={n} conc={c}: {r.tps:.1f} tok/s, TTFT p50 {r.ttft_p50:.3f} s", flush=True)
            rows.append(r)
    if conc_rows:
        print_concurrency(rows[: len(conc_rows)], a.new_tokens)
    if ctx_rows:
        print_context(rows[len(conc_rows) :], a.new_tokens)


if __name__ == "__main__":
    main()
