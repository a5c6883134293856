"""Graceful drain: SIGTERM to the launcher during 8 running OpenAI streams. Every stream finishes with all its
tokens, new requests are refused at once (HTTP 503, ZMQ ``unavailable``), ``/health`` says 503, and the whole
cluster exits within ``--shutdown-timeout``."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from loom_helpers import launch_http_cluster

from ipc.client import LoomClient, LoomError

pytestmark = pytest.mark.slow

STREAMS = 8
NEW_TOKENS = 48
SHUTDOWN_TIMEOUT_S = 60.0


def test_sigterm_drains_running_streams(tmp_path: Path) -> None:
    flags = ("--max-total-tokens", "4096", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    with launch_http_cluster(tmp_path / "cluster", *flags) as h:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{h.http_port}/v1", api_key="none", max_retries=0, timeout=120
        )
        base = client.models.list().data[0].id
        started = threading.Barrier(STREAMS + 1)
        results: dict[int, object] = {}

        def stream(i: int) -> None:
            try:
                chunks = client.chat.completions.create(
                    model=base,
                    messages=[{"role": "user", "content": f"Tell me story number {i}."}],
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, finish, usage, first = "", None, None, True
                for c in chunks:
                    if first:
                        first = False
                        started.wait(120)
                    if c.choices:
                        text += c.choices[0].delta.content or ""
                        finish = c.choices[0].finish_reason or finish
                    usage = c.usage or usage
                results[i] = (text, finish, usage.completion_tokens if usage else None)
            except Exception as e:  # noqa: BLE001 - reported by the assertions below
                results[i] = e
                started.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first chunk: all 8 are in flight
        signalled = time.monotonic()
        h.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the launcher forwards the drain to the front door

        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=base, prompt="late", max_tokens=2)
        assert e.value.status_code == 503 and "shutting down" in e.value.message
        with LoomClient(h.endpoint, timeout_s=30) as zc, pytest.raises(LoomError) as ze:
            zc.generate("late", sampling_params={"max_new_tokens": 2})
        assert ze.value.kind == "unavailable", ze.value
        conn = http.client.HTTPConnection("127.0.0.1", h.http_port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 503 and "shutting down" in json.loads(r.read())["reason"]
        conn.close()
        assert any(t.is_alive() for t in threads), "the streams ended before the checks: make them longer"

        for t in threads:
            t.join(SHUTDOWN_TIMEOUT_S)
        for i in range(STREAMS):
            assert isinstance(results.get(i), tuple), results.get(i)
            text, finish, completion_tokens = results[i]  # type: ignore[misc]
            assert finish == "length" and completion_tokens == NEW_TOKENS and text, results[i]
        code = h.proc.wait(SHUTDOWN_TIMEOUT_S + 15)
        took = time.monotonic() - signalled
        assert code == 0, h.log()[-3000:]
        assert took < SHUTDOWN_TIMEOUT_S, f"the cluster took {took:.1f} s to stop"
        log = h.log()
        assert "draining" in log and "front door drained" in log, log[-3000:]
        client.close()
