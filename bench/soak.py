#!/usr/bin/env python
"""Soak test: minutes of mixed traffic against a cluster of its own; errors, latency, tokens/s and RSS drift.

    python bench/soak.py --minutes 10 [--tp-size 1] [--concurrency 8] [--seed 0] [-- extra launch.py flags]

Starts ``launch.py`` on a private ipc endpoint with ``--enable-lora`` and four start-up adapters (one pinned)
from ``$LOOM_CACHE_DIR/test-adapters/<model>/`` (made there by ``scripts/make_adapters.py`` if missing, which
needs ``peft``), then runs the same traffic twice: a warm-up (``--warmup-s``, not counted), and the soak itself.

Traffic, all at once: ``--concurrency`` request loops spread over ``--clients`` AsyncLoomClients (base and
adapter requests, greedy, seeded and unseeded sampling, 8-64 new tokens; plain requests, streams read to the
end, streams closed after a few chunks and requests cancelled mid-way, both aborts), one load/unload loop for an
extra adapter name (``churn``, loaded from alternating folders, pinned sometimes, used, unloaded), one loop of
``list_loras``/``health`` calls, and occasional client disconnects with requests in flight (a client object
closed, a client subprocess killed, or frozen with SIGSTOP and then killed).

Checks, each reported: every error kind (``not_found`` for ``churn`` while it is not loaded is expected, the
rest are not); greedy and seeded outputs of the same prompt and adapter folder are prefixes of one another;
``list_loras`` shows what it must; no request is left running once traffic stops; no process restarted; and
each process's RSS (``VmRSS``), read with the cluster idle after the warm-up and again after the soak, grew by
at most ``--rss-threshold`` percent. Exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import QUESTIONS, ROOT, Cluster, cluster_procs, cpu_flags, cpu_s, loadavg, loom_cluster, quantile

TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "import numpy as np\n",
    "Dear Sir or Madam,",
]
STARTUP = {"a": "r8-all", "b": "r64-all", "c": "r16-attn", "d": "r32-qv"}  # name -> test adapter folder
PINNED = {"c"}
CHURN = "churn"
CHURN_FOLDERS = ["r16-rslora", "r8-pattern"]


# ----------------------------------------------------------------------------- processes and RSS


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_snapshot(launcher: int) -> dict[str, tuple[int, int, float]]:
    """name -> (pid, VmRSS KiB, CPU seconds used so far) for the whole cluster."""
    out = {}
    for name, pid in cluster_procs(launcher).items():
        kib = rss_kib(pid)
        if kib is not None:
            out[name] = (pid, kib, cpu_s(pid))
    return out


def torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


# ----------------------------------------------------------------------------- the cluster


def test_adapters(model_path: str | None) -> Path:
    """The folder holding the six test adapters for the model (made there once if missing)."""
    from ipc.model_source import cache_root, resolve_model_path

    mp = resolve_model_path(model_path)
    out = cache_root() / "test-adapters" / mp.name
    need = set(STARTUP.values()) | set(CHURN_FOLDERS)
    if not all((out / n / "adapter_model.safetensors").is_file() for n in need):
        from scripts.make_adapters import TEST_ADAPTERS, make_adapters

        print(f"making test adapters in {out} (needs peft) ...", flush=True)
        make_adapters(mp, out, TEST_ADAPTERS)
    return out


# ----------------------------------------------------------------------------- bookkeeping


@dataclass
class Stats:
    done: Counter = field(default_factory=Counter)  # completed requests by how they were made
    aborted: Counter = field(default_factory=Counter)  # ended by this client on purpose
    expected: Counter = field(default_factory=Counter)  # errors the traffic provokes on purpose
    unexpected: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # first message of each unexpected kind
    lat: dict[str, list[float]] = field(default_factory=dict)  # e2e / ttfc / admin latencies (s)
    tokens: int = 0  # completion tokens of completed requests
    partial_tokens: int = 0  # tokens aborted requests had received
    events: Counter = field(default_factory=Counter)  # churn loads, disconnects, ...

    def time(self, what: str, seconds: float) -> None:
        self.lat.setdefault(what, []).append(seconds)

    def bad(self, kind: str, detail: str) -> None:
        self.unexpected[kind] += 1
        self.examples.setdefault(kind, detail[:400])


@dataclass
class Spec:
    """One request to make."""

    prompt_key: str
    kw: dict[str, Any]  # text= or messages=
    adapter: str | None
    sp: dict[str, Any]
    check: bool  # greedy or seeded: its tokens must agree with every other run of the same key


class Soak:
    """The traffic loops and what they saw."""

    def __init__(self, endpoint: str, adapter_dir: Path, args: argparse.Namespace) -> None:
        self.endpoint = endpoint
        self.adapter_dir = adapter_dir
        self.args = args
        self.stats = Stats()
        self.stop_at = 0.0
        # the churn adapter as the churn loop knows it: its state changes only inside one load/unload call,
        # and ``churn_gen`` moves at every change, so a request that saw the same generation at both ends ran
        # entirely in one known state
        self.churn_state = "gone"  # gone | loading | loaded | unloading
        self.churn_path: str | None = None
        self.churn_pinned = False
        self.churn_gen = 0
        self.outputs: dict[tuple, list[int]] = {}  # check key -> longest token ids seen
        self.children: set[asyncio.subprocess.Process] = set()

    # -------------------------------------------------------------- requests

    def pick(self, rng: random.Random) -> Spec:
        if rng.random() < 0.6:
            i = rng.randrange(len(QUESTIONS))
            key, kw = f"chat{i}", {"messages": [{"role": "user", "content": QUESTIONS[i]}]}
        else:
            i = rng.randrange(len(TEXTS))
            key, kw = f"text{i}", {"text": TEXTS[i]}
        r = rng.random()
        adapter = None if r < 0.4 else CHURN if r < 0.55 else rng.choice(sorted(STARTUP))
        sp: dict[str, Any] = {"max_new_tokens": rng.randint(8, 64), "ignore_eos": rng.random() < 0.5}
        r = rng.random()
        if r < 0.5:
            sp["temperature"] = 0
        else:
            sp.update(temperature=0.8, top_p=0.9)
            if r < 0.75:
                sp["seed"] = rng.randint(1, 3)
        return Spec(key, kw, adapter, sp, check="seed" in sp or sp["temperature"] == 0)

    def _adapter_path(self, spec: Spec, gen: int) -> str | None:
        """The folder the request's adapter certainly had from send to end (None: unknown); "base" for none."""
        if spec.adapter is None:
            return "base"
        if spec.adapter == CHURN:
            return self.churn_path if gen == self.churn_gen and self.churn_state == "loaded" else None
        return STARTUP[spec.adapter]

    def _check(self, spec: Spec, gen: int, ids: list[int]) -> None:
        if not spec.check or not ids:
            return
        path = self._adapter_path(spec, gen)
        if path is None:
            return
        sp = spec.sp
        key = (spec.prompt_key, path, sp["temperature"], sp.get("top_p"), sp.get("seed"))
        seen = self.outputs.get(key)
        if seen is None:
            self.outputs[key] = list(ids)
            return
        n = min(len(seen), len(ids))
        if seen[:n] != ids[:n]:
            at = next(i for i in range(n) if seen[i] != ids[i])
            self.stats.bad(
                "output differs from an earlier run of the same greedy/seeded request",
                f"{key}: token {at}: {ids[max(0, at - 3) : at + 3]} vs earlier {seen[max(0, at - 3) : at + 3]}",
            )
        elif len(ids) > len(seen):
            self.outputs[key] = list(ids)

    def _failed(self, spec: Spec, gen: int, state: str, e: BaseException) -> None:
        from ipc.client import LoomError

        st = self.stats
        if isinstance(e, LoomError):
            if spec.adapter == CHURN and e.kind == "not_found":
                if gen == self.churn_gen and state == "loaded":
                    st.bad("not_found for the churn adapter while it was loaded", e.message)
                else:
                    st.expected["not_found: churn adapter unloaded or unloading"] += 1
                return
            st.bad(e.kind, f"{spec.adapter or 'base'}: {e.message}")
        else:
            st.bad(f"exception {type(e).__name__}", repr(e))

    async def request(self, client: Any, spec: Spec, mode: str, rng: random.Random) -> None:
        """One request; ``mode``: generate | stream | close (stream closed after a few chunks) | cancel."""
        gen, state = self.churn_gen, self.churn_state
        st = self.stats
        t0 = time.monotonic()
        kw = dict(spec.kw, sampling_params=spec.sp, lora_path=spec.adapter)
        ids: list[int] = []
        try:
            if mode == "generate":
                out = await client.generate(**kw)
                ids = out["output_ids"]
                st.time("e2e generate", time.monotonic() - t0)
                st.done["generate"] += 1
                st.tokens += out["meta_info"]["completion_tokens"]
            elif mode == "cancel":
                task = asyncio.ensure_future(client.generate(**kw))
                done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.05, 1.5))
                if done:
                    out = task.result()
                    ids = out["output_ids"]
                    st.time("e2e generate", time.monotonic() - t0)
                    st.done["generate"] += 1
                    st.tokens += out["meta_info"]["completion_tokens"]
                else:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    st.aborted["cancelled mid-request"] += 1
            else:
                limit = rng.randint(1, 4) if mode == "close" else None
                agen = client.generate_stream(**kw)
                n = 0
                last: dict[str, Any] | None = None
                try:
                    async for chunk in agen:
                        if n == 0:
                            st.time("ttfc stream", time.monotonic() - t0)
                        n += 1
                        last = chunk
                        ids = chunk["output_ids"]
                        if limit is not None and n >= limit:
                            break
                finally:
                    await agen.aclose()
                finished = last is not None and last["meta_info"].get("finish_reason") is not None
                if limit is not None and not finished:
                    st.aborted["stream closed early"] += 1
                    st.partial_tokens += len(ids)
                else:
                    st.time("e2e stream", time.monotonic() - t0)
                    st.done["stream"] += 1
                    st.tokens += len(ids)
            self._check(spec, gen, ids)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is counted by kind
            self._failed(spec, gen, state, e)

    async def worker(self, wid: int, client: Any) -> None:
        rng = random.Random(self.args.seed * 7919 + wid)
        while time.monotonic() < self.stop_at:
            r = rng.random()
            mode = "generate" if r < 0.35 else "stream" if r < 0.7 else "close" if r < 0.85 else "cancel"
            await self.request(client, self.pick(rng), mode, rng)

    # -------------------------------------------------------------- admin: churn, list, health

    async def _admin(self, pool: ThreadPoolExecutor, client: Any, what: str, fn: str, *a: Any) -> Any:
        t0 = time.monotonic()
        out = await asyncio.get_running_loop().run_in_executor(pool, lambda: getattr(client, fn)(*a))
        self.stats.time(what, time.monotonic() - t0)
        return out

    async def churn(self, client: Any, pool: ThreadPoolExecutor, req_client: Any) -> None:
        rng = random.Random(self.args.seed * 7919 + 1001)
        i = 0
        while time.monotonic() < self.stop_at:
            path = str(self.adapter_dir / CHURN_FOLDERS[i % len(CHURN_FOLDERS)])
            i += 1
            pinned = rng.random() < 0.3
            await self.churn_load(client, pool, path, pinned)
            if self.churn_state == "loaded":  # use it (the request loops use it too)
                await asyncio.gather(
                    *(self.request(req_client, self._churn_spec(rng), "generate", rng) for _ in range(2))
                )
                await asyncio.sleep(rng.uniform(1.0, 5.0))
            await self.churn_unload(client, pool)
            await asyncio.sleep(rng.uniform(0.3, 2.0))

    def _churn_spec(self, rng: random.Random) -> Spec:
        spec = self.pick(rng)
        spec.adapter = CHURN
        return spec

    async def churn_load(self, client: Any, pool: ThreadPoolExecutor, path: str, pinned: bool) -> None:
        from ipc.client import LoomError

        self.churn_state, self.churn_gen = "loading", self.churn_gen + 1
        try:
            await self._admin(pool, client, "lora load", "load_lora_adapter", CHURN, path, pinned)
        except LoomError as e:
            self.stats.bad("lora load failed", e.message)
            self.churn_state, self.churn_gen = "unknown", self.churn_gen + 1
            return
        self.churn_path, self.churn_pinned = path, pinned
        self.churn_state, self.churn_gen = "loaded", self.churn_gen + 1
        self.stats.events["churn loads (pinned)" if pinned else "churn loads (unpinned)"] += 1

    async def churn_unload(self, client: Any, pool: ThreadPoolExecutor) -> None:
        from ipc.client import LoomError

        if self.churn_state == "gone":
            return
        self.churn_state, self.churn_gen = "unloading", self.churn_gen + 1
        self.churn_path = None
        try:
            await self._admin(pool, client, "lora unload", "unload_lora_adapter", CHURN)
        except LoomError as e:
            if "never been loaded" not in e.message and "not loaded" not in e.message:
                self.stats.bad("lora unload failed", e.message)
                self.churn_state, self.churn_gen = "unknown", self.churn_gen + 1
                return
        self.churn_state, self.churn_gen = "gone", self.churn_gen + 1
        self.stats.events["churn unloads"] += 1

    async def admin(self, client: Any, pool: ThreadPoolExecutor) -> None:
        from ipc.client import LoomError

        rng = random.Random(self.args.seed * 7919 + 1002)
        while time.monotonic() < self.stop_at:
            try:
                if rng.random() < 0.5:
                    h = await self._admin(pool, client, "health", "health")
                    if h.get("message") != "ok":
                        self.stats.bad("health not ok", json.dumps(h))
                else:
                    gen, state, path, pinned = self.churn_gen, self.churn_state, self.churn_path, self.churn_pinned
                    rows = await self._admin(pool, client, "list_loras", "list_loras")
                    self.check_list(rows, gen, state, path, pinned)
            except LoomError as e:
                self.stats.bad(f"admin {e.kind}", e.message)
            await asyncio.sleep(rng.uniform(0.3, 1.5))

    def check_list(self, rows: list[dict], gen: int, state: str, path: str | None, pinned: bool) -> None:
        by_name = {r["name"]: r for r in rows}
        for name, folder in STARTUP.items():
            r = by_name.get(name)
            if r is None or Path(r["path"]).name != folder or r["pinned"] != (name in PINNED):
                self.stats.bad("list_loras wrong", f"start-up adapter {name}: {r}")
        if gen != self.churn_gen:
            return  # the churn adapter changed meanwhile: either answer is right
        r = by_name.get(CHURN)
        if state == "gone" and r is not None:
            self.stats.bad("list_loras wrong", f"{CHURN} is listed after its unload returned: {r}")
        if state == "loaded" and (r is None or r["path"] != path or r["pinned"] != pinned):
            self.stats.bad("list_loras wrong", f"{CHURN} loaded from {path} (pinned {pinned}) but listed as {r}")

    # -------------------------------------------------------------- disconnects

    async def disconnects(self) -> None:
        rng = random.Random(self.args.seed * 7919 + 1003)
        while True:
            wait = rng.uniform(0.5, 1.5) * self.args.disconnect_every_s
            if time.monotonic() + wait >= self.stop_at:
                return
            await asyncio.sleep(wait)
            how = rng.choice(["close", "kill", "freeze"])
            try:
                if how == "close":
                    await self.disconnect_close(rng)
                else:
                    await self.disconnect_child(rng, freeze=how == "freeze")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self.stats.bad(f"disconnect ({how}) exception {type(e).__name__}", repr(e))

    async def disconnect_close(self, rng: random.Random) -> None:
        """A client object closed while its requests run (no abort is sent: the server must notice)."""
        from ipc.client import AsyncLoomClient

        c = AsyncLoomClient(self.endpoint, timeout_s=self.args.timeout_s)
        flowing = asyncio.Event()

        async def one(spec: Spec) -> None:
            kw = dict(spec.kw, sampling_params=dict(spec.sp, max_new_tokens=64, ignore_eos=True))
            lora = None if spec.adapter == CHURN else spec.adapter  # it must run: no not_found
            async for _ in c.generate_stream(**kw, lora_path=lora):
                flowing.set()

        tasks = [asyncio.ensure_future(one(self.pick(rng))) for _ in range(rng.randint(2, 4))]
        try:
            await asyncio.wait_for(flowing.wait(), self.args.timeout_s)
            await asyncio.sleep(rng.uniform(0.0, 1.0))
        except asyncio.TimeoutError:
            self.stats.bad("disconnect (close): no chunk within --timeout-s", "")
        finally:
            c.close()  # first: the tasks' clean-up then sends no abort
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.stats.events["disconnects: client closed"] += 1

    async def disconnect_child(self, rng: random.Random, freeze: bool) -> None:
        """A client process killed (or frozen, then killed) while its requests run."""
        adapters = [a for a in sorted(STARTUP) if rng.random() < 0.5]
        p = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            "_client",
            self.endpoint,
            str(rng.randrange(2**31)),
            json.dumps(adapters),
            stdout=asyncio.subprocess.PIPE,
            cwd=str(ROOT),
        )
        self.children.add(p)
        try:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), self.args.timeout_s)
            if line.strip() != b"flowing":
                self.stats.bad("disconnect client: no chunk", line.decode(errors="replace"))
            await asyncio.sleep(rng.uniform(0.1, 1.5))
            if freeze:
                _signal(p, signal.SIGSTOP)
                await asyncio.sleep(3.0)  # the front door drops a client silent for 1.2 s
        except asyncio.TimeoutError:
            self.stats.bad("disconnect client: no chunk within --timeout-s", "")
        finally:
            _signal(p, signal.SIGKILL)
            await p.wait()
            self.children.discard(p)
        self.stats.events["disconnects: client frozen, then killed" if freeze else "disconnects: client killed"] += 1

    # -------------------------------------------------------------- phases

    async def phase(self, seconds: float, clients: list[Any], admin_clients: list[Any], rss: Any = None) -> float:
        """Run all traffic for ``seconds``; return the wall time until the last request ended."""
        t0 = time.monotonic()
        self.stop_at = t0 + seconds
        pools = [ThreadPoolExecutor(1) for _ in admin_clients]
        tasks = [asyncio.ensure_future(self.worker(i, clients[i % len(clients)])) for i in range(self.args.concurrency)]
        tasks.append(asyncio.ensure_future(self.churn(admin_clients[0], pools[0], clients[0])))
        tasks.append(asyncio.ensure_future(self.admin(admin_clients[1], pools[1])))
        tasks.append(asyncio.ensure_future(self.disconnects()))
        bg = [asyncio.ensure_future(rss())] if rss is not None else []
        grace = seconds + self.args.timeout_s + 30
        done, pending = await asyncio.wait(tasks, timeout=grace)
        for t in pending:
            t.cancel()
        if pending:
            self.stats.bad("traffic loop still running long after the end", f"{len(pending)} loops")
        for t in done:
            if t.exception() is not None:
                self.stats.bad(f"traffic loop crashed: {type(t.exception()).__name__}", repr(t.exception()))
        elapsed = time.monotonic() - t0
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, *pending, return_exceptions=True)
        for p in list(self.children):
            _signal(p, signal.SIGKILL)
            await p.wait()
        if self.churn_state != "gone":
            await self.churn_unload(admin_clients[0], pools[0])
        for pool in pools:
            pool.shutdown()
        return elapsed

    async def idle(self, client: Any, timeout_s: float = 30.0) -> int:
        """Wait until the front door holds no request; returns how many it still held at the timeout."""
        from ipc.client import LoomError

        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                running = (await loop.run_in_executor(None, client.health)).get("running", 0)
            except LoomError as e:
                self.stats.bad(f"admin {e.kind}", e.message)
                running = -1
            if running == 0 or time.monotonic() > deadline:
                return running
            await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- the disconnecting client


def _signal(p: asyncio.subprocess.Process, sig: int) -> None:
    """Signal a child unless asyncio saw it exit. Not ``p.send_signal``/``p.kill``: before Python 3.13 those go
    through ``Popen.send_signal``, whose ``poll()`` can reap the child before asyncio's child watcher does (it then
    logs "Unknown child process pid N, will report returncode 255"; CPython gh-87744)."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


async def child_client(endpoint: str, seed: int, adapters: list[str]) -> None:
    """Hidden mode ``_client``: start a few long streams, say ``flowing`` at the first chunk, read forever."""
    from ipc.client import AsyncLoomClient

    rng = random.Random(seed)
    async with AsyncLoomClient(endpoint) as c:
        flowing = asyncio.Event()

        async def one(i: int) -> None:
            q = QUESTIONS[rng.randrange(len(QUESTIONS))]
            lora = adapters[i % len(adapters)] if adapters and i % 2 else None
            sp = {"max_new_tokens": 64, "ignore_eos": True, "temperature": rng.choice([0, 0.8])}
            async for _ in c.generate_stream(
                messages=[{"role": "user", "content": q}], sampling_params=sp, lora_path=lora
            ):
                flowing.set()

        tasks = [asyncio.ensure_future(one(i)) for i in range(rng.randint(2, 5))]
        await flowing.wait()
        print("flowing", flush=True)
        await asyncio.gather(*tasks, return_exceptions=True)
        print("finished", flush=True)


# ----------------------------------------------------------------------------- report


def log_summary(path: Path) -> tuple[Counter, list[str]]:
    """(WARNING/ERROR lines per process and level, restart lines) in the cluster log."""
    counts: Counter = Counter()
    restarts = []
    pat = re.compile(r"^\S+ \S+ (\S+) (WARNING|ERROR|CRITICAL) (.*)$")
    for line in path.read_text(errors="replace").splitlines():
        m = pat.match(line)
        if m:
            msg = re.sub(r"[0-9a-f]{32}|\d+(\.\d+)?", "#", m.group(3))[:110]
            counts[(m.group(1), m.group(2), msg)] += 1
        if "Traceback" in line:
            counts[("?", "TRACEBACK", "Traceback in the log")] += 1
        if re.search(r"restart|replac", line, re.I) and " launch " in line:
            restarts.append(line[:200])
    return counts, restarts


def report(
    a: argparse.Namespace,
    flags: str,
    soak: Soak,
    warm: Stats,
    elapsed: float,
    rss0: dict,
    rss1: dict,
    peaks: dict,
    leftover: int,
    log_path: Path,
) -> int:
    st = soak.stats
    fails = []
    print(
        f"\nLoom soak: {elapsed / 60:.1f} min of traffic (+{a.warmup_s:g} s warm-up, not counted), "
        f"tp_size={a.tp_size}, concurrency {a.concurrency} over {a.clients} clients, seed {a.seed}"
    )
    print(f"cluster flags: {flags}")
    print(f"cpu flags: {cpu_flags()}; {os.cpu_count()} cpus")
    print(f"torch {torch_version()}, python {platform.python_version()}")

    n_done = sum(st.done.values())
    n_ab = sum(st.aborted.values())
    print(
        f"\nrequests done: {n_done} completed ({', '.join(f'{k} {v}' for k, v in sorted(st.done.items()))}); "
        f"{n_ab} aborted by the client ({', '.join(f'{k} {v}' for k, v in sorted(st.aborted.items())) or '-'})"
    )
    print("events: " + ", ".join(f"{k} {v}" for k, v in sorted(st.events.items())))
    print(f"greedy/seeded outputs cross-checked: {len(soak.outputs)} distinct (prompt, adapter folder, sampling) keys")
    print("errors, expected: " + (", ".join(f"{k} {v}" for k, v in sorted(st.expected.items())) or "none"))
    unexpected = Counter(st.unexpected)
    for k, v in warm.unexpected.items():
        unexpected[f"warm-up: {k}"] += v
        st.examples.setdefault(k, warm.examples.get(k, ""))
    if leftover:
        unexpected["requests still running 30 s after the traffic stopped"] += 1
        st.examples.setdefault("requests still running 30 s after the traffic stopped", f"{leftover} running")
    print("errors, unexpected: " + ("none" if not unexpected else ""))
    for k, v in sorted(unexpected.items()):
        print(f"  {v:>6}  {k}: {st.examples.get(k.removeprefix('warm-up: '), '')}")
    if unexpected:
        fails.append(f"{sum(unexpected.values())} unexpected errors")

    print(f"\n{'latency (s)':<16}{'n':>7}{'p50':>9}{'p99':>9}{'max':>9}")
    for what in ["e2e generate", "e2e stream", "ttfc stream", "lora load", "lora unload", "list_loras", "health"]:
        xs = st.lat.get(what, [])
        if xs:
            print(f"{what:<16}{len(xs):>7}{quantile(xs, 0.5):>9.3f}{quantile(xs, 0.99):>9.3f}{max(xs):>9.3f}")
    e2e = st.lat.get("e2e generate", []) + st.lat.get("e2e stream", [])
    if e2e:
        print(f"{'e2e all':<16}{len(e2e):>7}{quantile(e2e, 0.5):>9.3f}{quantile(e2e, 0.99):>9.3f}{max(e2e):>9.3f}")
    print(
        f"tokens/s: {st.tokens / elapsed:.1f} (completed requests' {st.tokens} tokens over {elapsed:.0f} s; "
        f"{(st.tokens + st.partial_tokens) / elapsed:.1f} with the {st.partial_tokens} of closed streams)"
    )

    wcpu = sum(rss1[n][2] - rss0[n][2] for n in rss0 if n.startswith("gpu_worker") and n in rss1)
    if wcpu > 0:
        print(
            f"gpu_worker CPU: {wcpu:.0f} s ({wcpu / elapsed * 100:.0f}% of one core over the soak; the machine's "
            f"load average at the end: {loadavg()}), {st.tokens / wcpu:.1f} completed tokens per worker CPU-second"
        )
    print(f"\n{'RSS (MiB)':<22}{'pid':>8}{'start':>10}{'end':>10}{'drift':>9}{'peak':>10}{'CPU s':>9}")
    for name in sorted(set(rss0) | set(rss1), key=lambda n: (n != "launcher", n)):
        p0, k0, c0 = rss0.get(name, (None, None, None))
        p1, k1, c1 = rss1.get(name, (None, None, None))
        if p0 is None or p1 is None or p0 != p1:
            print(f"{name:<22}{str(p0):>8}  changed pid or gone: {p0} -> {p1}")
            fails.append(f"{name} was replaced or vanished (pid {p0} -> {p1})")
            continue
        drift = (k1 - k0) / k0 * 100
        peak = peaks.get(p0, max(k0, k1))
        print(
            f"{name:<22}{p0:>8}{k0 / 1024:>10.1f}{k1 / 1024:>10.1f}{drift:>+8.2f}%{peak / 1024:>10.1f}{c1 - c0:>9.0f}"
        )
        if drift > a.rss_threshold:
            fails.append(f"{name} RSS grew {drift:+.2f}% (> {a.rss_threshold:g}%)")

    counts, restarts = log_summary(log_path)
    n_warn = sum(v for (_, lvl, _), v in counts.items() if lvl == "WARNING")
    n_err = sum(counts.values()) - n_warn
    print(f"\ncluster log: {n_warn} warnings, {n_err} errors/tracebacks" + ("; most frequent:" if counts else ""))
    for (proc, lvl, msg), v in counts.most_common(8):
        print(f"  {v:>6}  {proc} {lvl} {msg}")
    for line in restarts[:5]:
        print(f"  restart: {line}")
    if restarts:
        fails.append(f"{len(restarts)} restart lines in the launcher log")
    print(f"\nresult: {'FAIL: ' + '; '.join(fails) if fails else 'PASS'}")
    return 1 if fails else 0


# ----------------------------------------------------------------------------- main


async def run(a: argparse.Namespace, cluster: Cluster, adapter_dir: Path, flags: str) -> int:
    from ipc.client import AsyncLoomClient, LoomClient

    soak = Soak(cluster.endpoint, adapter_dir, a)
    clients = [AsyncLoomClient(cluster.endpoint, timeout_s=a.timeout_s) for _ in range(a.clients)]
    admins = [LoomClient(cluster.endpoint, timeout_s=a.timeout_s) for _ in range(2)]
    peaks: dict[int, int] = {}

    async def sample_rss() -> None:
        t0 = last = time.monotonic()
        prev = rss_snapshot(cluster.proc.pid)
        while True:
            snap = rss_snapshot(cluster.proc.pid)
            for _, (pid, kib, _) in snap.items():
                peaks[pid] = max(peaks.get(pid, 0), kib)
            if time.monotonic() - last >= a.progress_s:
                dt, last = time.monotonic() - last, time.monotonic()
                st = soak.stats
                cpu = {n: (c - prev[n][2]) / dt * 100 for n, (_, _, c) in snap.items() if n in prev}
                print(
                    f"  [{last - t0:4.0f} s] completed {sum(st.done.values())}, aborted {sum(st.aborted.values())}, "
                    f"unexpected {sum(st.unexpected.values())}; load {loadavg()}; CPU %, RSS MiB: "
                    + ", ".join(f"{n} {cpu.get(n, 0):.0f}, {k / 1024:.0f}" for n, (_, k, _) in sorted(snap.items())),
                    flush=True,
                )
                prev = snap
            await asyncio.sleep(5)

    try:
        print(f"warm-up: {a.warmup_s:g} s of the same traffic ...", flush=True)
        await soak.phase(a.warmup_s, clients, admins)
        warm, soak.stats = soak.stats, Stats()
        left = await soak.idle(admins[1])
        if left:
            warm.bad("requests still running 30 s after the warm-up", f"{left} running")
        await asyncio.sleep(2)
        rss0 = rss_snapshot(cluster.proc.pid)
        print(
            f"warm-up done: {sum(warm.done.values())} completed, {sum(warm.unexpected.values())} unexpected errors; "
            f"RSS at start: " + ", ".join(f"{n} {k / 1024:.0f} MiB" for n, (_, k, _) in sorted(rss0.items())),
            flush=True,
        )
        print(f"soak: {a.minutes:g} min ...", flush=True)
        elapsed = await soak.phase(a.minutes * 60, clients, admins, sample_rss)
        leftover = await soak.idle(admins[1])
        await asyncio.sleep(2)
        rss1 = rss_snapshot(cluster.proc.pid)
    finally:
        for c in clients:
            c.close()
        for c in admins:
            c.close()
    return report(a, flags, soak, warm, elapsed, rss0, rss1, peaks, leftover, cluster.log_path)


def _short(flag: str) -> str:
    """A ``--lora-paths`` entry with its folder shortened to the adapter's folder name."""
    if flag.startswith("{"):
        d = json.loads(flag)
        return f"{d['lora_name']}={Path(d['lora_path']).name}(pinned)"
    if "=" in flag and "/" in flag:
        name, path = flag.split("=", 1)
        return f"{name}={Path(path).name}"
    return flag


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_client"]:
        asyncio.run(child_client(argv[1], int(argv[2]), json.loads(argv[3])))
        return 0
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="soak length (after the warm-up)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="warm-up traffic before the RSS baseline")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8, help="request loops")
    p.add_argument("--clients", type=int, default=3, help="AsyncLoomClients the request loops share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-threshold", type=float, default=5.0, help="largest RSS growth per process, percent")
    p.add_argument("--disconnect-every-s", type=float, default=20.0, help="mean time between client disconnects")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request without a reply this long fails")
    p.add_argument("--progress-s", type=float, default=60.0, help="print a progress line this often")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    if a.concurrency < 1 or a.clients < 1:
        p.error("--concurrency and --clients must be at least 1")

    model = extra[extra.index("--model-path") + 1] if "--model-path" in extra[:-1] else None
    adapter_dir = test_adapters(model)
    lora_paths = [
        json.dumps({"lora_name": n, "lora_path": str(adapter_dir / f), "pinned": True})
        if n in PINNED
        else f"{n}={adapter_dir / f}"
        for n, f in STARTUP.items()
    ]
    flags = [
        "--tp-size",
        str(a.tp_size),
        "--enable-lora",
        "--max-loras-per-batch",
        "4",
        "--lora-paths",
        *lora_paths,
        *extra,
    ]
    shown = " ".join(_short(f) for f in flags)
    print(f"starting: launch.py {shown} (adapters in {adapter_dir})", flush=True)
    with loom_cluster(*flags, timeout_s=a.ready_timeout, prefix="loom-soak-") as cluster:
        print(f"cluster up (launcher pid {cluster.proc.pid}, log {cluster.log_path})", flush=True)
        code = asyncio.run(run(a, cluster, adapter_dir, shown))
        cluster.keep_log = bool(code)  # a failed soak keeps its log (the path goes to stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
