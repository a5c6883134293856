"""Tests of the HTTP API (tokenizer_proc/http_app.py on uvicorn, tokenizer_proc/http_server.py).

A real cluster is started the way a user starts one (``python launch.py --http-port ...``, through
``loom_helpers.launch_http_cluster``) and driven with the standard library only: ``http.client`` for HTTP, and a
raw ``socket`` for requests no HTTP client would send. The last tests serve the app over a scripted front door
in-process, for paths a real cluster rarely takes on demand.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from loom_helpers import ClusterHandle, launch_http_cluster
from prometheus_client.parser import text_string_to_metric_families

from ipc.messages import AdminOut, ErrorOut, FinishReason, GenerateOut, GenerateReq, MetaInfo
from tokenizer_proc.health import ClusterHealth
from tokenizer_proc.http_io import HttpSink
from tokenizer_proc.http_server import HttpServer, start_http
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.registry import LoraRegistry

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

slow = pytest.mark.slow  # tests that start a cluster


class Cluster:
    """The HTTP port of a running cluster (``port``) and its launcher handle."""

    def __init__(self, handle: ClusterHandle) -> None:
        self.handle = handle
        self.port = handle.http_port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_http_cluster(tmp_path_factory.mktemp("http"), "--max-total-tokens", "4096") as h:
        yield Cluster(h)


# ----------------------------------------------------------------------------- HTTP helpers


def call(
    port: int, method: str, path: str, body: object = None, conn: http.client.HTTPConnection | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request; ``body`` is JSON-encoded unless it is bytes. Returns (status, lower-cased headers, body)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    if conn is None:
        c.close()
    return out


def call_json(port: int, method: str, path: str, body: object = None) -> tuple[int, dict]:
    status, headers, data = call(port, method, path, body)
    assert headers["content-type"].startswith("application/json"), headers
    return status, json.loads(data)


def raw(port: int, data: bytes) -> bytes:
    """Send raw bytes, return everything the server answers before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def read_events(r: http.client.HTTPResponse) -> list[str]:
    """The ``data:`` payloads of a server-sent-event response, in order."""
    events = []
    while line := r.readline():
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data: "):
            events.append(line[len(b"data: ") :].decode())
        else:
            assert line == b"", f"unexpected SSE line {line!r}"
    return events


def assert_healthy(port: int) -> None:
    assert call_json(port, "GET", "/health") == (200, {"status": "ok"})


def running_requests(port: int) -> float:
    _, _, data = call(port, "GET", "/metrics")
    m = re.search(rb"^loom_running_requests (\S+)$", data, re.M)
    assert m is not None, data[:2000]
    return float(m.group(1))


def wait_idle(port: int, within_s: float) -> None:
    """Wait until the front door has no request in flight (an abort must have happened)."""
    deadline = time.monotonic() + within_s
    while running_requests(port) != 0:
        assert time.monotonic() < deadline, "request still running after its client disconnected"
        time.sleep(0.1)


# ----------------------------------------------------------------------------- tests


@slow
def test_health_and_model_info(server: Cluster) -> None:
    assert_healthy(server.port)
    status, info = call_json(server.port, "GET", "/get_model_info")
    assert status == 200 and info["model_path"] and info["is_generation"] is True


@slow
def test_generate_greedy(server: Cluster) -> None:
    req = {"messages": FRANCE, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    status, out = call_json(server.port, "POST", "/generate", req)
    assert status == 200, out
    assert "Paris" in out["text"], out
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")


@slow
def test_generate_stream_is_cumulative(server: Cluster) -> None:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    req = {"text": "Once upon a time", "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    c.request("POST", "/generate", body=json.dumps(req), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type", "").startswith("text/event-stream")
    events = read_events(r)
    assert events[-1] == "[DONE]" and len(events) >= 2, events
    chunks = [json.loads(e) for e in events[:-1]]
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert (
            cur["text"].startswith(prev["text"]) and cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        )
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6 == len(chunks[-1]["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    # the connection is reusable after a complete chunked stream
    sock = c.sock
    assert call(server.port, "GET", "/health", conn=c)[0] == 200 and c.sock is sock
    c.close()


@slow
@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "Expected `object`"),
        ({"text": "hi", "temprature": 0}, 400, "temprature"),
        ({"text": "hi", "sampling_params": {"max_tokens": 4}}, 400, "max_tokens"),
        ({"text": ""}, 400, "empty"),
        ({"text": "hi", "input_ids": [1]}, 400, "exactly one"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 100000}}, 400, "max_new_tokens"),
        ({"text": "hi", "lora_path": "some-adapter"}, 400, "--enable-lora"),
    ],
)
def test_generate_bad_request(server: Cluster, body: object, status: int, needle: str) -> None:
    got, out = call_json(server.port, "POST", "/generate", body)
    assert got == status, out
    assert out["error"]["kind"] == "bad_request" and needle in out["error"]["message"], out
    assert_healthy(server.port)


@slow
def test_routing_errors(server: Cluster) -> None:
    status, out = call_json(server.port, "GET", "/no/such/path")
    assert status == 404 and out["error"]["kind"] == "not_found"
    status, headers, data = call(server.port, "GET", "/generate")
    assert status == 405 and headers["allow"] == "POST", data
    status, headers, _ = call(server.port, "POST", "/health", {})
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert_healthy(server.port)


@slow
def test_protocol_errors(server: Cluster) -> None:
    p = server.port
    assert raw(p, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(p, b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(p, b"POST /generate HTTP/1.1\r\nContent-Length: -1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # chunked request bodies are read (this one is not JSON)
    chunked = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    out = raw(p, chunked + b"5\r\nhello\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and b"not valid JSON" in out, out
    big = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (64 << 20)
    assert raw(p, big).startswith(b"HTTP/1.1 413 ")
    assert raw(p, b"GET /" + b"x" * 20000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # two pipelined requests on one connection, the second asking to close it
    out = raw(p, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 2 and out.endswith(b'{"status":"ok"}')
    # HTTP/1.0: answered, then closed
    assert raw(p, b"GET /health HTTP/1.0\r\n\r\n").endswith(b'{"status":"ok"}')
    assert_healthy(p)


@slow
def test_head_keeps_the_connection_framed(server: Cluster) -> None:
    """HEAD answers headers only (a GET route 200, a POST route 405), so the next response on the same
    keep-alive connection starts right after them (the old server sent a 405 with a body here)."""
    for path in (b"/health", b"/generate"):
        out = raw(
            server.port,
            b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path,
        )
        head, sep, rest = out.partition(b"\r\n\r\n")
        assert sep and rest.startswith(b"HTTP/1.1 200 OK\r\n"), out
        assert head.startswith(b"HTTP/1.1 200 " if path == b"/health" else b"HTTP/1.1 405 "), out
        assert rest.endswith(b'{"status":"ok"}'), out


@slow
def test_keep_alive_survives_client_errors(server: Cluster) -> None:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    assert call(server.port, "GET", "/health", conn=c)[0] == 200
    sock = c.sock
    assert call(server.port, "POST", "/generate", b"{bad", conn=c)[0] == 400
    assert call(server.port, "GET", "/nope", conn=c)[0] == 404
    assert call(server.port, "GET", "/health", conn=c)[0] == 200
    assert c.sock is sock, "a JSON-level error must not close the connection"
    c.close()


@slow
def test_client_disconnect_aborts(server: Cluster) -> None:
    p = server.port
    long_req = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    # streaming client leaves after the first chunk
    c = http.client.HTTPConnection("127.0.0.1", p, timeout=60)
    c.request("POST", "/generate", body=json.dumps({**long_req, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: {")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    wait_idle(p, 10.0)  # 300 tokens would take far longer than this
    # non-streaming client leaves while waiting for its result
    with socket.create_connection(("127.0.0.1", p)) as s:
        body = json.dumps(long_req).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while running_requests(p) == 0:  # it is running before its client leaves
            assert time.monotonic() < deadline
            time.sleep(0.05)
    wait_idle(p, 10.0)
    # the server still serves
    status, out = call_json(p, "POST", "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3


@slow
def test_lora_admin_without_lora(server: Cluster) -> None:
    assert call_json(server.port, "GET", "/list_loras") == (200, {"adapters": []})
    status, out = call_json(server.port, "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"})
    assert status == 400 and "--enable-lora" in out["error"]["message"]
    status, out = call_json(server.port, "POST", "/load_lora_adapter", {"lora_name": "a"})
    assert status == 400 and "lora_path" in out["error"]["message"]
    status, out = call_json(server.port, "POST", "/unload_lora_adapter", {"lora_name": "a"})
    assert status == 404 and "never been loaded" in out["error"]["message"]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed with prometheus_client: ``{(sample name, sorted label items): value}``."""
    _, _, data = call(port, "GET", "/metrics")
    out = {}
    for fam in text_string_to_metric_families(data.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def http_count(m: dict, path: str, status: int, outcome: str) -> float:
    return m.get(("loom_http_requests_total", (("outcome", outcome), ("path", path), ("status", str(status)))), 0.0)


def duration_count(m: dict, path: str, outcome: str) -> float:
    return m.get(("loom_http_request_duration_seconds_count", (("outcome", outcome), ("path", path))), 0.0)


@slow
def test_metrics(server: Cluster) -> None:
    assert call(server.port, "GET", "/health")[0] == 200  # counted below, whichever tests ran before
    status, headers, data = call(server.port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    m = scrape(server.port)
    assert http_count(m, "/health", 200, "success") >= 1
    assert ("loom_healthy", ()) in m and ("vllm:num_requests_waiting", ()) in m


@slow
def test_every_request_is_counted_once_with_its_outcome(server: Cluster) -> None:
    """A client that leaves a non-streaming /generate after 200 ms, or a stream after its first event, is counted
    once as client_disconnected (status 499) with a latency sample; a complete request once as success."""
    p = server.port
    long_req = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    before = scrape(p)
    body = json.dumps(long_req).encode()
    with socket.create_connection(("127.0.0.1", p)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)
    body = json.dumps({**long_req, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", p), timeout=60) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: {" not in got:  # the first event
            got += s.recv(65536)
    wait_idle(p, 10.0)
    status, out = call_json(p, "POST", "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, out
    after = scrape(p)
    assert (
        http_count(after, "/generate", 499, "client_disconnected")
        - http_count(before, "/generate", 499, "client_disconnected")
        == 2
    )
    assert (
        duration_count(after, "/generate", "client_disconnected")
        - duration_count(before, "/generate", "client_disconnected")
        == 2
    )
    assert http_count(after, "/generate", 200, "success") - http_count(before, "/generate", 200, "success") == 1
    assert duration_count(after, "/generate", "success") - duration_count(before, "/generate", "success") == 1


def _make_adapter(folder: Path) -> None:
    """A tiny random PEFT-format LoRA (r=4 on q_proj/v_proj of every layer) without importing peft."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(30):
        for mod, out_dim in (("q_proj", 576), ("v_proj", 192)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(4, 576, generator=g) * 0.05
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out_dim, 4, generator=g) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


@slow
def test_lora_admin_endpoints(tmp_path: Path) -> None:
    # its own cluster, with --enable-lora (in a full run the base cluster idles meanwhile)
    adapter = tmp_path / "adapters" / "tiny"
    _make_adapter(adapter)
    with launch_http_cluster(tmp_path / "cluster", "--enable-lora", "--max-lora-rank", "8") as lc:
        p = lc.http_port
        status, out = call_json(p, "POST", "/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(adapter)})
        assert status == 200 and out["success"] is True, out
        status, out = call_json(p, "GET", "/list_loras")
        assert status == 200 and [a["name"] for a in out["adapters"]] == ["tiny"], out
        assert out["adapters"][0]["rank"] == 4
        status, out = call_json(p, "POST", "/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(adapter)})
        assert status == 400 and "already loaded" in out["error"]["message"]
        status, out = call_json(
            p, "POST", "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "missing")}
        )
        assert status == 400 and "bad" in out["error"]["message"]
        req = {"text": "Hello", "lora_path": "tiny", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
        status, out = call_json(p, "POST", "/generate", req)
        assert status == 200 and out["meta_info"]["lora_path"] == "tiny", out
        status, out = call_json(p, "POST", "/unload_lora_adapter", {"lora_name": "tiny"})
        assert status == 200 and out["success"] is True, out
        assert call_json(p, "GET", "/list_loras") == (200, {"adapters": []})
        status, out = call_json(p, "POST", "/generate", req)
        assert status == 404 and "never been loaded: tiny" in out["error"]["message"], out
        status, out = call_json(p, "POST", "/generate", {**req, "stream": True})
        assert status == 404 and out["error"]["kind"] == "not_found"


# ----------------------------------------------------------------------------- in-process, with a scripted door
# Paths a real cluster rarely takes on demand: errors after streaming began, server errors, shutdown mid-request.


class FakeDoor:
    """Stands in for FrontDoor: ``text`` picks a script of replies."""

    def __init__(self) -> None:
        self.args = SimpleNamespace(
            model_path="/models/fake", enable_lora=True, served_model_name="fake", max_loras_per_batch=8
        )
        self.context_len = 4096
        self.vocab_size = 100
        self.pending: dict[str, object] = {}
        self.sinks: list[HttpSink] = []
        self.aborted: list[str] = []
        self.health = ClusterHealth(silence_limit_s=float("inf"))  # no scheduler sends heartbeats here
        self.registry = LoraRegistry()
        self.codec = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(map(str, ids)))
        self.metrics = Metrics()
        self.metrics.watch(self)  # type: ignore[arg-type]

    async def generate(self, req: GenerateReq, sink: HttpSink) -> None:
        loop = asyncio.get_running_loop()
        self.sinks.append(sink)

        def chunk(n: int, finished: bool = False) -> GenerateOut:
            fr = FinishReason("length") if finished else None
            return GenerateOut("r", "ab"[:n], list(range(n)), MetaInfo("r", 3, n, fr), finished)

        if req.text == "midstream-error":
            loop.call_later(0.01, sink.send, chunk(1))
            loop.call_later(0.05, sink.send, ErrorOut("r", "rank 1 died", "server_error"))
        elif req.text == "not-found":
            sink.send(ErrorOut("r", "no such adapter", "not_found"))
        elif req.text == "crash":
            raise KeyError("bug")
        elif req.text == "hang":
            if req.stream:
                loop.call_later(0.01, sink.send, chunk(1))
        else:
            loop.call_later(0.01, sink.send, chunk(1))
            loop.call_later(0.02, sink.send, chunk(2, finished=True))

    def abort_sink(self, sink: HttpSink, reason: str) -> int:
        self.aborted.append(reason)
        return 1

    def fail_all(self, message: str) -> None:
        for s in self.sinks:
            s.send(ErrorOut("r", message, "server_error"))

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdminOut:
        raise RuntimeError("LoRA operation 1 got no answer in 300 s")


Fake = tuple[HttpServer, FakeDoor, asyncio.AbstractEventLoop]


@pytest.fixture
def fake() -> Iterator[Fake]:
    """The HTTP server over a FakeDoor, served from an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    door = FakeDoor()
    api = asyncio.run_coroutine_threadsafe(start_http(door, "127.0.0.1", 0), loop).result(10)  # type: ignore[arg-type]
    try:
        yield api, door, loop
    finally:
        asyncio.run_coroutine_threadsafe(api.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _post(port: int, body: dict) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/generate", body=json.dumps(body))
    return c.getresponse()


def test_fake_error_mapping(fake: Fake) -> None:
    api, door, _ = fake
    assert call_json(api.port, "POST", "/generate", {"text": "ok"})[1]["text"] == "ab"
    status, out = call_json(api.port, "POST", "/generate", {"text": "midstream-error"})
    assert status == 500 and out == {"error": {"message": "rank 1 died", "kind": "server_error"}}
    status, out = call_json(api.port, "POST", "/generate", {"text": "not-found", "stream": True})
    assert status == 404 and out["error"]["kind"] == "not_found"
    status, out = call_json(api.port, "POST", "/generate", {"text": "crash"})
    assert status == 500 and "KeyError" in out["error"]["message"]
    status, out = call_json(api.port, "POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert status == 500 and "no answer" in out["error"]["message"]
    assert call_json(api.port, "GET", "/get_model_info")[1]["model_path"] == "/models/fake"


def test_fake_error_after_stream_started(fake: Fake) -> None:
    api, _, _ = fake
    r = _post(api.port, {"text": "midstream-error", "stream": True})
    assert r.status == 200
    events = read_events(r)
    assert json.loads(events[0])["text"] == "a"
    assert json.loads(events[1]) == {"error": {"message": "rank 1 died", "kind": "server_error"}}
    assert events[2:] == ["[DONE]"]


def test_fake_shutdown_answers_requests_in_flight(fake: Fake) -> None:
    api, door, loop = fake
    plain = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    plain.request("POST", "/generate", body=json.dumps({"text": "hang"}))
    stream = _post(api.port, {"text": "hang", "stream": True})
    assert stream.readline().startswith(b"data: {")
    deadline = time.monotonic() + 5
    while len(door.sinks) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)

    async def shutdown() -> None:  # what tokenizer_proc.main does when the cluster stops
        door.fail_all("server shutting down")
        await api.stop()

    stopped = asyncio.run_coroutine_threadsafe(shutdown(), loop)
    r = plain.getresponse()
    assert r.status == 500 and json.loads(r.read())["error"]["message"] == "server shutting down"
    rest = read_events(stream)
    assert rest == ['{"error":{"message":"server shutting down","kind":"server_error"}}', "[DONE]"], rest
    stopped.result(10)


def test_fake_health_is_503_while_the_tp_group_restarts(fake: Fake) -> None:
    api, door, _ = fake
    assert call_json(api.port, "GET", "/health") == (200, {"status": "ok"})
    door.health.unavailable = "TP group restarting (epoch 2): gpu_worker[1] exited with code -9 (SIGKILL)"
    status, body = call_json(api.port, "GET", "/health")
    assert status == 503 and body == {"status": "unavailable", "reason": door.health.unavailable}
    door.health.unavailable = None
    assert call_json(api.port, "GET", "/health")[0] == 200
