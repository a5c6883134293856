"""Prometheus metrics of the front door (``GET /metrics``), for dashboards and LoRA-aware gateways.

Two kinds:

- **Events**, counted as they happen (the front door calls :class:`Metrics`' methods): prompt and generation
  tokens, time to first token, inter-token latency, end-to-end latency, requests by outcome and adapter,
  adapter load latency, and every HTTP request once with its real outcome (``client_disconnected`` for a
  client that left before its response was complete).
- **State**, read at scrape time (:class:`DoorCollector`): requests running and waiting and KV-cache use
  (from the scheduler's last heartbeat), adapter residency (``slot``, ``host``, ``ref-cache``), slot
  evictions, health, failover counters, and vLLM's ``vllm:lora_requests_info`` gauge plus the vLLM-named
  queue and KV gauges that gateway endpoint pickers read by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenizer_proc.health import ClusterHealth
from tokenizer_proc.metrics_carry import STATE_FILE, CarryOver

disable_created_metrics()  # no *_created series: half the exposition, and nothing here reads them

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Door(Protocol):
    """What :class:`DoorCollector` reads from the front door."""

    pending: dict[str, Any]
    health: ClusterHealth
    args: Any
    registry: Any


class Metrics:
    """The registry and the event metrics; one per front door."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.carry: CarryOver | None = None  # set by watch()
        r = self.registry
        self.prompt_tokens = Counter("loom_prompt_tokens", "Prompt tokens of requests submitted", registry=r)
        self.generation_tokens = Counter("loom_generation_tokens", "Tokens generated and delivered", registry=r)
        self.finished_prompt_tokens = Counter(
            "loom_prompt_tokens_finished", "Prompt tokens of requests that ended (the hit ratio's base)", registry=r
        )
        self.cached_tokens = Counter(
            "loom_prompt_tokens_cached", "Prompt tokens of ended requests read from the prefix cache", registry=r
        )
        self.hit_ratio = Gauge(
            "loom_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens, over requests that ended",
            registry=r,
        )
        self._prompt_total = self._cached_total = 0
        self.hit_ratio.set_function(self._hit_ratio)
        self.ttft = Histogram(
            "loom_time_to_first_token_seconds",
            "From a request's arrival at the front door to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loom_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loom_e2e_request_latency_seconds",
            "From a request's arrival at the front door to its end",
            ["finish_reason"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "loom_requests", "Requests sent to the scheduler that ended, by how", ["finish_reason"], registry=r
        )
        self.lora_requests = Counter(
            "loom_lora_requests", "Requests sent to the scheduler per LoRA adapter", ["lora_name"], registry=r
        )
        self.lora_load = Histogram(
            "loom_lora_load_seconds",
            "LoRA adapter loads on every TP rank (load: explicit, reload: for a request, restore: after a restart)",
            ["kind"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.http_requests = Counter(
            "loom_http_requests",
            "HTTP requests, each counted once at its end (status 499 = the client disconnected first)",
            ["path", "status", "outcome"],
            registry=r,
        )
        self.http_duration = Histogram(
            "loom_http_request_duration_seconds",
            "HTTP requests from arrival to the last byte (or to the client's disconnect)",
            ["path", "outcome"],
            buckets=HTTP_BUCKETS,
            registry=r,
        )

    # ------------------------------------------------------------------ request events (ZMQ and HTTP alike)
    def request_submitted(self, prompt_tokens: int, lora_name: str | None) -> None:
        """A request went to the scheduler."""
        self.prompt_tokens.inc(prompt_tokens)
        if lora_name is not None:
            self.lora_requests.labels(lora_name).inc()

    def tokens_delivered(self, n: int, first_after_s: float | None, gap_s: float | None) -> None:
        """``n`` new tokens of one request: ``first_after_s`` since arrival when they are its first, else
        ``gap_s`` since its previous tokens (spread evenly over the ``n``)."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if first_after_s is not None:
            self.ttft.observe(first_after_s)
            n -= 1
            gap_s = None
        if gap_s is not None:
            for _ in range(n):
                self.itl.observe(gap_s / n)

    def request_finished(self, e2e_s: float, finish_reason: str) -> None:
        """A request sent to the scheduler ended: ``stop``, ``length``, ``abort`` or ``error``."""
        self.requests.labels(finish_reason).inc()
        self.e2e.labels(finish_reason).observe(e2e_s)

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request ended: ``cached_tokens`` of its ``prompt_tokens`` came from the prefix cache."""
        self.finished_prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens

    def _hit_ratio(self) -> float:
        return 0.0 if self._prompt_total == 0 else self._cached_total / self._prompt_total

    def lora_loaded(self, kind: str, seconds: float) -> None:
        """An adapter finished loading on every rank (``load``, ``reload`` or ``restore``)."""
        self.lora_load.labels(kind).observe(seconds)

    def http_request(self, path: str, status: int, outcome: str, seconds: float) -> None:
        """One HTTP request ended (``outcome``: success, client_error, server_error, client_disconnected)."""
        self.http_requests.labels(path, str(status), outcome).inc()
        self.http_duration.labels(path, outcome).observe(seconds)

    # ------------------------------------------------------------------ scrape
    def watch(self, door: Door) -> None:
        """Add the scrape-time state of ``door`` (gauges, residency, failover counters), and carry the counters
        of a previous front door of the same cluster over (:mod:`tokenizer_proc.metrics_carry`; its state file
        lives in the cluster's socket folder, none without one)."""
        self.registry.register(DoorCollector(door))
        endpoints = getattr(door.args, "endpoints", None)  # test doubles may have none
        folder = endpoints.socket_dir if endpoints is not None else ""
        self.carry = CarryOver(self.registry, Path(folder) / STATE_FILE if folder else None, door.health)
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(self.carry)

    def exposition(self) -> bytes:
        """Everything in Prometheus' text format (``CONTENT_TYPE``); what it shows is saved for a successor."""
        if self.carry is None:
            return generate_latest(self.registry)
        text = generate_latest(self._exposed)
        self.carry.save()
        return text


class FailoverCollector:
    """Prometheus counters of the front door's :class:`ClusterHealth` (restarts, resumed requests, lost
    adapters), read at scrape time."""

    def __init__(self, health: ClusterHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        """Yield the three counter families."""
        restarts = CounterMetricFamily(
            "loom_process_restarts", "Processes restarted by the launcher after a death or hang", labels=["process"]
        )
        for proc, n in sorted(self.health.restarts.items()):
            restarts.add_metric([proc], n)
        yield restarts
        yield CounterMetricFamily(
            "loom_requests_resumed", "Running requests re-admitted after a TP group restart", value=self.health.resumed
        )
        yield CounterMetricFamily(
            "loom_lora_adapters_lost",
            "Adapters a restart could not restore (folder gone, files changed or invalid)",
            value=self.health.adapters_lost,
        )


class DoorCollector:
    """State read from the front door and the scheduler's last heartbeat at scrape time."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self.failover = FailoverCollector(door.health)

    def collect(self) -> Iterator[Metric]:
        """Yield the gauges (Loom's names, then the vLLM names gateways read) and the counters."""
        door = self.door
        health = door.health
        beat = health.beat
        running = beat.running if beat else 0
        waiting = beat.waiting if beat else 0
        usage = beat.kv_used_tokens / beat.kv_capacity_tokens if beat and beat.kv_capacity_tokens else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("loom_running_requests", "Requests the front door is waiting on (HTTP and ZMQ)", len(door.pending))
        yield gauge("loom_num_requests_running", "Requests in the scheduler's running batch", running)
        yield gauge("loom_num_requests_waiting", "Requests in the scheduler's waiting queue", waiting)
        yield gauge("loom_kv_cache_usage_ratio", "Share of KV-cache token slots held or reserved (0-1)", usage)
        yield gauge("loom_healthy", "1 while /health answers 200, else 0", 1.0 if health.problem() is None else 0.0)
        yield CounterMetricFamily(
            "loom_lora_slot_evictions", "Adapters evicted from a slot by another adapter", value=health.slot_evictions
        )
        yield from self._residency()
        yield from self.failover.collect()
        # the names LoRA-aware gateway endpoint pickers read (vLLM's)
        yield gauge("vllm:num_requests_running", "Requests in the running batch (vLLM's name)", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run (vLLM's name)", waiting)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = 100% (vLLM's name)", usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100% (vLLM's name)", usage)
        if door.args.enable_lora:
            yield self._lora_info()

    def _names(self) -> dict[str, str]:
        """uid -> adapter name for every adapter the registry holds, is loading or unloading, or lately dropped
        (a request for an adapter being unloaded still runs under its uid)."""
        return self.door.registry.uid_names()

    def _residency(self) -> Iterator[Metric]:
        reg = self.door.registry
        beat = self.door.health.beat
        in_slot = set(beat.slot_uids) if beat else set()
        fam = GaugeMetricFamily(
            "loom_lora_adapter_residency",
            "1 per adapter, labelled with its tier: slot (in a rank's slot), host (host memory), ref-cache "
            "(evicted from host memory; reloaded on its next request)",
            labels=["lora_name", "tier"],
        )
        for name, e in sorted(reg.loaded.items()):
            fam.add_metric([name, "slot" if e.uid in in_slot else "host"], 1)
        for name in sorted(set(reg.refs) - set(reg.loaded)):
            fam.add_metric([name, "ref-cache"], 1)
        yield fam

    def _lora_info(self) -> Metric:
        """vLLM's ``lora_requests_info``: adapters of running and waiting requests (comma-separated), the batch's
        adapter capacity, and as value the time of the heartbeat it describes (gateways take the newest)."""
        health = self.door.health
        beat = health.beat
        names = self._names()

        def joined(uids: list[str]) -> str:
            return ",".join(sorted(names.get(u, u) for u in uids))

        fam = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (vLLM's name; the value is the update time)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        running = joined(beat.running_lora_uids) if beat else ""
        waiting = joined(beat.waiting_lora_uids) if beat else ""
        # what one batch can mix, as the scheduler sizes it from the workers' pools (adapters read in place need no
        # device slot, so there it is the running batch's size); --max-loras-per-batch until the first beat
        cap = beat.max_batch_loras if beat and beat.max_batch_loras else self.door.args.max_loras_per_batch
        fam.add_metric([running, waiting, str(cap)], health.beat_wall_time)
        return fam
