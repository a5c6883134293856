#!/usr/bin/env python
"""Many adapters: Zipf traffic over 1,000 LoRA adapters against the same traffic over 8, and adapter load times.

    python bench/many_adapters.py [--adapters 1000] [--hot-adapters 8] [--requests 256] [--concurrency 32]
                                  [--new-tokens 32] [--prompt-tokens 64] [--zipf-alpha 1.0]
                                  [--max-loras-per-batch 8] [--max-loaded-loras 64] [--ranks 8,12,16]
                                  [--targets q_proj,v_proj] [--load-samples 8] [--dtype bfloat16] [--tp-size 1]
                                  [--max-lora-rank R] [--repeats 1] [--length-spread 0.5] [--cold-files]

Adapters: ``--adapters`` random PEFT adapters (ranks cycled over ``--ranks``, ``--targets`` in every layer, bf16
safetensors) made once by ``scripts/make_adapters.py`` under ``$LOOM_CACHE_DIR/bench-many-adapters/``; their
size on disk is printed before they are made (1,000 at ranks 8-16 on q_proj,v_proj: 1.4 GB; all seven linears:
7.3 GB). One cluster serves both runs with ``--max-loras-per-batch`` slots and a host tier of
``--max-loaded-loras`` adapters, so most of the 1,000 live only in the ref cache and a request for one reloads
it from disk (on Linux, usually from the page cache: the files were just written or read).

1. Registration: every adapter is loaded once through the client API (``load_lora_adapter``; a request may
   only name an adapter the cluster knows). Each call is timed: disk -> host tier on every rank, plus one
   host-tier eviction once the tier is full.
2. Load probes, one 1-token greedy request at a time on the idle cluster (``--load-samples`` each): TTFT of a
   request whose adapter is in a slot (hot), in the host tier but in no slot (warm: host -> slot), and only in
   the ref cache (cold: disk -> host -> slot). The warm and cold cost is their TTFT minus the TTFT of the same
   adapter's request sent right after (hot by then), p50 over the samples.
3. Throughput: ``--requests`` streamed requests of ``--prompt-tokens`` random token ids and about ``--new-tokens``
   tokens (``ignore_eos``; each request's count drawn uniformly within ``--length-spread`` of it, the same counts in
   both runs: with equal lengths the clients finish and resubmit in lockstep waves, whose come and go swung
   single-run ratios by +-0.1), ``--concurrency`` at a time, each naming an adapter drawn Zipf(``--zipf-alpha``) over
   ``--hot-adapters`` adapters, then (same prompts, same seed) over all ``--adapters``; each run follows a warm-up of
   ``--concurrency`` x 2 requests of its own traffic. Prints tokens/s, the ratio many / few (the goal is >= 0.90),
   TTFT and end-to-end percentiles, and how many reloads from disk and host-tier evictions the cluster log shows
   during each run. ``in flight`` is the mean number of distinct adapters among the requests in flight: where slots
   are copies (the torch path, GPUs) and it is above what they hold, some requests must wait for a slot whatever the
   speed of loading; where the C kernel reads adapters in place (CPUs) the pool has a slot per running request (the
   ``LoRA pool:`` line says which). ``--cold-files`` drops the adapters' weight files from the page cache every
   0.1 s during the runs, so reloads read the disk (as when the adapters outgrow the page cache).

Copied slots hold ``--max-loras-per-batch`` x ``--max-lora-rank`` rank rows, which adapters share at their own
rank (``--max-lora-rank`` defaults to the largest of ``--ranks``: 8 slots then hold about 10 adapters of ranks
8-16; a server sized for rank 64 holds about 40 of them in the same 8 slots).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, add_quantization_arg, bench_header, loadavg, loom_cluster, median, quantile, random_prompt_ids

sys.path.insert(0, str(ROOT / "scripts"))


def zipf_draws(n_items: int, n: int, alpha: float, seed: int) -> list[int]:
    """``n`` item indices in [0, n_items) with P(i) proportional to (i + 1) ** -alpha (item 0 most popular)."""
    weights = [(i + 1) ** -alpha for i in range(n_items)]
    return random.Random(seed).choices(range(n_items), weights=weights, k=n)


@dataclass
class RunStats:
    """One traffic run."""

    wall: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    distinct: int = 0
    in_flight: float = 0.0  # mean number of distinct adapters among the requests in flight
    reloads: int = 0  # "reloading LoRA adapter" lines in the cluster log during the run
    evictions: int = 0  # host-tier evictions in the cluster log during the run
    cpu: float = 0.0  # CPU seconds of the gpu_worker processes during the run

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall else float("nan")

    @property
    def tok_per_cpu(self) -> float:
        """Tokens per worker CPU-second (less sensitive to other load on the machine than tok/s)."""
        return self.tokens / self.cpu if self.cpu else float("nan")


def new_token_counts(n: int, mean: int, spread: float, seed: int) -> list[int]:
    """``n`` output lengths drawn uniformly from ``mean * (1 +- spread)`` (at least 1), the same for a seed."""
    rng = random.Random(seed)
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def traffic(
    endpoint: str, prompts: list[list[int]], loras: list[str], new_tokens: list[int], conc: int
) -> RunStats:
    """Stream every (prompt, adapter, output length) with ``conc`` requests in flight at any time."""
    from ipc.client import AsyncLoomClient, LoomError

    st = RunStats(distinct=len(set(loras)))
    jobs = list(zip(prompts, loras, new_tokens, strict=True))
    jobs.reverse()

    inflight: Counter = Counter()  # adapter -> requests in flight
    samples: list[int] = []

    async def worker(c: AsyncLoomClient) -> None:
        while jobs:
            ids, lora, want = jobs.pop()
            sp = {"max_new_tokens": want, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            first, n = None, 0
            inflight[lora] += 1
            try:
                async for chunk in c.generate_stream(input_ids=ids, sampling_params=sp, lora_path=lora):
                    n = len(chunk["output_ids"])
                    if first is None and n:
                        first = time.perf_counter() - t0
            except LoomError as e:
                st.errors[f"{e.kind}: {e.message.splitlines()[0][:120]}"] += 1
                continue
            finally:
                inflight[lora] -= 1
                if not inflight[lora]:
                    del inflight[lora]
            st.e2e.append(time.perf_counter() - t0)
            st.ttft.append(first if first is not None else st.e2e[-1])
            st.tokens += n

    async def sample() -> None:
        while True:
            samples.append(len(inflight))
            await asyncio.sleep(0.02)

    async with AsyncLoomClient(endpoint) as c:
        sampler = asyncio.ensure_future(sample())
        t = time.perf_counter()
        await asyncio.gather(*[worker(c) for _ in range(conc)])
        st.wall = time.perf_counter() - t
        sampler.cancel()
    st.in_flight = sum(samples) / max(1, len(samples))
    return st


@contextlib.contextmanager
def evicting_page_cache(folders: list[Path], period_s: float = 0.1) -> Iterator[None]:
    """While inside, drop ``folders``' adapter weight files from the page cache every ``period_s`` seconds
    (``posix_fadvise`` DONTNEED: clean pages leave the cache, so the next read goes to the disk)."""
    from ipc.lora_config import WEIGHTS_FILE

    stop = threading.Event()

    def evict() -> None:
        while not stop.is_set():
            for d in folders:
                try:
                    fd = os.open(d / WEIGHTS_FILE, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            stop.wait(period_s)

    if not folders:
        yield
        return
    t = threading.Thread(target=evict, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def log_counts(log_path: Path) -> tuple[int, int]:
    """(reloads from disk, host-tier evictions) logged so far."""
    text = log_path.read_text(errors="replace")
    return len(re.findall(r"reloading LoRA adapter ", text)), len(re.findall(r"host tier full ", text))


def probe(client, lora: str | None, ids: list[int]) -> float:
    """Seconds until the first token of a 1-token greedy request (on an idle cluster: its whole latency)."""
    t = time.perf_counter()
    client.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}, lora_path=lora)
    return time.perf_counter() - t


def load_probes(client, names: list[str], samples: int, vocab: int) -> dict[str, list[float]]:
    """TTFT of 1-token requests: base, hot (in a slot), warm (host tier only), cold (ref cache only); and the
    warm and cold cost, each paired with the same adapter's request right after (hot by then)."""
    seeds = itertools.count(7)

    def ids() -> list[int]:
        """A new prompt for every probe: a repeated one would hit the prefix cache and make the second of a
        pair look faster for that reason alone."""
        return random_prompt_ids(16, vocab, next(seeds))

    out: dict[str, list[float]] = {k: [] for k in ("base", "hot", "warm", "cold", "warm cost", "cold cost")}
    rng = random.Random(1)
    probe(client, None, ids())  # warm-up
    for _ in range(samples):
        out["base"].append(probe(client, None, ids()))
        resident = {r["name"]: r for r in client.list_loras()}
        in_slot = sorted(n for n, r in resident.items() if r["slots"])
        no_slot = sorted(n for n, r in resident.items() if not r["slots"])
        evicted = sorted(set(names) - set(resident))
        if in_slot:
            out["hot"].append(probe(client, rng.choice(in_slot), ids()))
        for kind, pool in (("warm", no_slot), ("cold", evicted)):
            if pool:
                name = rng.choice(pool)
                t = probe(client, name, ids())
                again = probe(client, name, ids())
                out[kind].append(t)
                out["hot"].append(again)
                out[f"{kind} cost"].append(t - again)
    return out


def register(client, adapters: dict[str, Path]) -> list[float]:
    """Load every adapter through the client API; seconds per call."""
    times = []
    t_last = time.monotonic()
    for i, (name, path) in enumerate(adapters.items()):
        t = time.perf_counter()
        client.load_lora_adapter(name, str(path))
        times.append(time.perf_counter() - t)
        if time.monotonic() - t_last > 15:
            t_last = time.monotonic()
            print(f"  registered {i + 1}/{len(adapters)} (p50 {median(times) * 1000:.0f} ms per load)", flush=True)
    return times


def make_set(a: argparse.Namespace, model_path: Path) -> tuple[dict[str, Path], Path]:
    """The adapters (made once under the cache), printing their size on disk."""
    from make_adapters import make_random_adapters, random_adapter_bytes

    from ipc.model_source import cache_root

    ranks = tuple(int(x) for x in a.ranks.split(","))
    targets = tuple(a.targets.split(","))
    tag = f"{'-'.join(t.removesuffix('_proj') for t in targets)}-r{'-'.join(map(str, ranks))}-bf16"
    out = cache_root() / "bench-many-adapters" / model_path.name / tag
    per = [ranks[i % len(ranks)] for i in range(a.adapters)]
    est = random_adapter_bytes(model_path, per, list(targets))
    print(f"adapters: {a.adapters} in {out}, ranks {a.ranks}, targets {a.targets}, {est / 1e9:.2f} GB of tensors")
    t = time.perf_counter()
    adapters = make_random_adapters(model_path, out, a.adapters, ranks, targets)
    size = sum(f.stat().st_size for p in adapters.values() for f in p.iterdir())
    print(f"  ready in {time.perf_counter() - t:.1f} s (made or reused); {size / 1e9:.2f} GB on disk", flush=True)
    return adapters, out


# why a load probe row can be empty: the cluster held no adapter in that state at any probe
WHY_NO_PROBE = {
    "hot": "no adapter was in a slot",
    "warm": "every adapter in the host tier was in a slot",
    "cold": "every adapter fit in the host tier (--adapters <= --max-loaded-loras): none was on disk only",
}


def ms(xs: list[float], q: float = 0.5) -> str:
    return f"{quantile(xs, q) * 1000:8.1f}" if xs else f"{'-':>8}"


def pool_line(log_text: str) -> str:
    """How the workers' LoRA pools hold adapters, from the cluster log: read in place (how many a batch may mix)
    or copied into ``--max-loras-per-batch`` slots, and the backend line."""
    backend = re.search(r"LoRA backend on TP rank 0: (.*)", log_text)
    in_place = re.search(r"LoRA adapters are read in place from the host tier: a batch may mix up to (\d+)", log_text)
    how = f"read in place, up to {in_place.group(1)} adapters per batch" if in_place else "copied into slots"
    return f"LoRA pool: {how}; backend {backend.group(1) if backend else '?'}"


def report(
    a: argparse.Namespace, reg: list[float], probes: dict[str, list[float]], few: RunStats, many: RunStats, pool: str
):
    print(
        f"\ntraffic: {a.requests} requests, {a.prompt_tokens}-token prompts, {a.new_tokens} new tokens "
        f"(+-{a.length_spread:.0%}), "
        f"{a.concurrency} in flight, Zipf alpha {a.zipf_alpha:g}; --max-loras-per-batch {a.max_loras_per_batch}, "
        f"--max-lora-rank {a.max_lora_rank}, --max-loaded-loras {a.max_loaded_loras}\n{pool}"
    )
    print(
        f"{'':<16}{'adapters':>9}{'distinct':>9}{'in flight':>10}{'reloads':>8}{'evicts':>7}{'tok/s':>9}{'ratio':>7}"
        f"{'tok/cpu-s':>10}{'ratio':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>9}{'e2e p99':>9}{'errors':>7}"
    )
    for n, st in ((a.hot_adapters, few), (a.adapters, many)):
        print(
            f"{f'{n} adapters':<16}{n:>9}{st.distinct:>9}{st.in_flight:>10.1f}{st.reloads:>8}{st.evictions:>7}"
            f"{st.tps:>9.1f}{st.tps / few.tps:>7.2f}{st.tok_per_cpu:>10.1f}{st.tok_per_cpu / few.tok_per_cpu:>7.2f}"
            f"{quantile(st.ttft, 0.5):>10.3f}{quantile(st.ttft, 0.99):>10.3f}{quantile(st.e2e, 0.5):>9.3f}"
            f"{quantile(st.e2e, 0.99):>9.3f}{sum(st.errors.values()):>7}"
        )
        for k, v in st.errors.most_common(3):
            print(f"    {v} x {k}")
    ratio = many.tps / few.tps
    print(
        f"many / few tokens/s: {ratio:.2f} (goal >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'}); per worker "
        f"CPU-second: {many.tok_per_cpu / few.tok_per_cpu:.2f}"
    )
    print(f"\nadapter load times (ms; TTFT of 1-token requests on the idle cluster, p50 / p99 of {a.load_samples})")
    print(f"{'':<58}{'p50':>8}{'p99':>8}{'cost p50':>10}")
    print(f"{'load_lora_adapter call (disk -> host tier, every rank)':<58}{ms(reg)}{ms(reg, 0.99)}")
    rows = [
        ("base model request", "base"),
        ("adapter in a slot (hot)", "hot"),
        ("adapter in host tier, no slot (warm: host -> slot)", "warm"),
        ("adapter on disk only (cold: disk -> host -> slot)", "cold"),
    ]
    for label, key in rows:
        xs = probes[key]
        cost = probes.get(f"{key} cost")
        extra = f"{quantile(cost, 0.5) * 1000:>10.1f}" if cost else ""
        if not xs and key in WHY_NO_PROBE:
            extra = f"  ({WHY_NO_PROBE[key]})"
        print(f"{label:<58}{ms(xs)}{ms(xs, 0.99)}{extra}")
    print(
        f"(load_lora_adapter: {len(reg)} calls; past --max-loaded-loras each also evicts one adapter. cost: TTFT "
        "minus the same adapter's next request, hot by then)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--hot-adapters", type=int, default=8, help="adapters of the comparison run")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=64, help="host tier (most adapters stay on disk)")
    p.add_argument("--ranks", default="8,12,16")
    p.add_argument("--max-lora-rank", type=int, default=0, help="the pools' largest rank (default: of --ranks)")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated; all seven take 5x the disk")
    p.add_argument("--load-samples", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    add_quantization_arg(p)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--length-spread", type=float, default=0.5,
        help="each request's new tokens drawn uniformly within this fraction of --new-tokens (0: all equal)",
    )  # fmt: skip
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="few/many run pairs in turns on one cluster (each many run makes other adapters popular, so its "
        "first uses are disk loads again); the report shows the pair of median ratio and lists every ratio",
    )
    p.add_argument(
        "--cold-files", action="store_true",
        help="during the runs, drop the adapters' weight files from the page cache every 0.1 s (posix_fadvise "
        "DONTNEED), so reloads read the disk, as when the adapters outgrow the page cache",
    )  # fmt: skip
    a = p.parse_args()
    if a.adapters < 1:
        p.error(f"--adapters must be at least 1, not {a.adapters}")
    if not 0 < a.hot_adapters <= a.adapters:
        p.error("--hot-adapters must be between 1 and --adapters")
    if not 0 <= a.length_spread < 1:
        p.error("--length-spread must be in [0, 1)")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, not {a.repeats}")
    try:
        ranks = [int(r) for r in a.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks must be comma-separated whole numbers, not {a.ranks!r}")
    if min(ranks) < 1:
        p.error(f"--ranks must all be at least 1, not {a.ranks!r}")
    from ipc.lora_config import LLAMA_LORA_MODULES

    targets = a.targets.split(",")
    unknown = sorted(set(targets) - set(LLAMA_LORA_MODULES))
    if unknown:
        named = ", ".join(repr(t) for t in unknown)
        p.error(f"--targets: unknown module(s) {named}; choose from {', '.join(LLAMA_LORA_MODULES)}")
    if len(set(targets)) < len(targets):
        p.error(f"--targets names a module twice: {a.targets!r}")
    if a.max_lora_rank and max(ranks) > a.max_lora_rank:
        p.error(f"--ranks {a.ranks} exceed --max-lora-rank {a.max_lora_rank}: the server would refuse those adapters")
    a.max_lora_rank = a.max_lora_rank or max(ranks)
    from ipc.client import LoomClient
    from ipc.model_config import load_model_config
    from ipc.model_source import resolve_model_path

    model_path = resolve_model_path(None)
    cfg = load_model_config(model_path)
    vocab = cfg.vocab_size
    if max(ranks) > cfg.hidden_size:
        p.error(f"--ranks {a.ranks}: a rank above the model's hidden size ({cfg.hidden_size}) adds nothing")
    quant = f"Loom --quantization {a.quantization}"
    title = "bench/many_adapters.py: Zipf traffic over many adapters"
    print(bench_header(title, dtype=a.dtype, tp_size=a.tp_size, extra=quant))
    adapters, folder = make_set(a, model_path)
    names = list(adapters)
    prompts = [random_prompt_ids(a.prompt_tokens, vocab, a.seed * 100_000 + i) for i in range(a.requests)]
    warm_n = 2 * a.concurrency
    warm_prompts = [random_prompt_ids(a.prompt_tokens, vocab, -1 - i) for i in range(warm_n)]
    lengths = new_token_counts(a.requests, a.new_tokens, a.length_spread, a.seed)
    warm_lengths = new_token_counts(warm_n, a.new_tokens, a.length_spread, a.seed + 1)
    flags = [
        "--dtype", a.dtype, "--quantization", a.quantization, "--tp-size", str(a.tp_size), "--enable-lora",
        "--lora-root", str(folder),
        "--max-loras-per-batch", str(a.max_loras_per_batch), "--max-loaded-loras", str(a.max_loaded_loras),
        "--max-lora-rank", str(a.max_lora_rank), "--lora-target-modules",
        *a.targets.split(","), "--max-total-tokens", str(a.concurrency * (a.prompt_tokens + max(lengths)) + 256),
    ]  # fmt: skip
    print(f"cluster: launch.py {' '.join(flags)}", flush=True)
    with loom_cluster(*flags) as cluster, LoomClient(cluster.endpoint) as client:
        print(f"registering {len(names)} adapters through load_lora_adapter ...", flush=True)
        t = time.perf_counter()
        reg = register(client, adapters)
        print(f"  done in {time.perf_counter() - t:.1f} s; load probes ...", flush=True)
        probes = load_probes(client, names, a.load_samples, vocab)
        pairs: list[tuple[RunStats, RunStats]] = []
        for r in range(a.repeats):
            runs = []
            for n in (a.hot_adapters, a.adapters):
                # the many run of repeat r makes a different part of the set popular (a rotation by 97 per
                # repeat), so its adapters are not left warm in the host tier by the repeat before
                shift = 97 * r if n == a.adapters else 0
                named = names[shift:] + names[:shift]
                pick = [named[i] for i in zipf_draws(n, a.requests, a.zipf_alpha, a.seed)]
                warm = [named[i] for i in zipf_draws(n, warm_n, a.zipf_alpha, a.seed + 1)]
                asyncio.run(traffic(cluster.endpoint, warm_prompts, warm, warm_lengths, a.concurrency))
                r0, e0 = log_counts(cluster.log_path)
                cpu0 = cluster.worker_cpu_s()
                with evicting_page_cache(list(adapters.values()) if a.cold_files else []):
                    st = asyncio.run(traffic(cluster.endpoint, prompts, pick, lengths, a.concurrency))
                st.cpu = cluster.worker_cpu_s() - cpu0
                r1, e1 = log_counts(cluster.log_path)
                st.reloads, st.evictions = r1 - r0, e1 - e0
                print(f"  {n} adapters: {st.tps:.1f} tok/s, {st.distinct} distinct, {st.reloads} reloads", flush=True)
                runs.append(st)
            pairs.append((runs[0], runs[1]))
        pool = pool_line(cluster.log_path.read_text(errors="replace"))
    by_ratio = sorted(pairs, key=lambda fm: fm[1].tps / fm[0].tps)
    report(a, reg, probes, *by_ratio[(len(by_ratio) - 1) // 2], pool)  # the lower middle one for an even count
    if a.repeats > 1:
        ratios = ", ".join(f"{m.tps / f.tps:.2f}" for f, m in pairs)
        which = "median" if a.repeats % 2 else "lower of the two middle"
        print(f"many / few tokens/s of each repeat, in order: {ratios} (the table shows the {which} pair)")
    print(f"load average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
