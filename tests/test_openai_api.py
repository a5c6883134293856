"""The OpenAI-compatible API, driven with the official ``openai`` client (sync and async, streamed and not)
against one live cluster with two LoRA adapters; plus ``/metrics`` before and after a known workload, and
``/health`` while a TP worker is stopped with SIGSTOP (the last test: it pauses the cluster).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest
from loom_helpers import ClusterHandle, launch_http_cluster
from lora_helpers import real_adapters
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    ad = real_adapters()
    flags = ["--enable-lora", "--max-loras-per-batch", "4", "--max-total-tokens", "8192"]
    flags += ["--lora-paths", f"a={ad['r8-all']}", f"b={ad['r64-all']}"]
    with launch_http_cluster(tmp_path_factory.mktemp("openai"), *flags) as h:
        yield h


@pytest.fixture(scope="module")
def client(cluster: ClusterHandle) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def base(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def native(cluster: ClusterHandle, path: str, body: dict | None = None) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    try:
        c.request("GET" if body is None else "POST", path, body=None if body is None else json.dumps(body))
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def greedy_native(cluster: ClusterHandle, lora: str | None, **prompt: object) -> dict:
    body = {**prompt, "lora_path": lora, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    status, out = native(cluster, "/generate", body)
    assert status == 200, out
    return out


def scrape(cluster: ClusterHandle) -> dict[tuple[str, tuple], float]:
    c = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# ----------------------------------------------------------------------------- models and plain requests


def test_models_lists_the_base_and_adapters_with_their_parent(client: openai.OpenAI, base: str) -> None:
    cards = {m.id: m.to_dict() for m in client.models.list().data}
    assert list(cards) == [base, "a", "b"], cards
    assert cards[base]["parent"] is None and cards[base]["object"] == "model"
    assert cards["a"]["parent"] == base and cards["b"]["parent"] == base
    assert cards["a"]["root"].endswith("r8-all")
    assert client.models.retrieve("a").to_dict() == cards["a"]  # GET /v1/models/{id}
    assert client.models.retrieve(base).to_dict() == cards[base]
    assert client.models.retrieve(f"{base}:a").to_dict() == cards["a"]  # as a request's model may name it
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")


def test_chat_and_completions_on_the_base_model(cluster: ClusterHandle, client: openai.OpenAI, base: str) -> None:
    chat = client.chat.completions.create(model=base, messages=FRANCE, temperature=0, max_tokens=16)
    choice = chat.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and chat.model == base and chat.object == "chat.completion"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert choice.message.content == greedy_native(cluster, None, messages=FRANCE)["text"]
    done = client.completions.create(model=base, prompt="The quick brown fox", temperature=0, max_tokens=16)
    ref = greedy_native(cluster, None, text="The quick brown fox")
    assert done.choices[0].text == ref["text"] and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] and done.usage.completion_tokens == 16
    # "n": null is OpenAI's default (one choice)
    body = {"model": base, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 16, "n": None}
    status, out = native(cluster, "/v1/completions", body)
    assert status == 200 and [c["text"] for c in out["choices"]] == [ref["text"]], out


@pytest.mark.parametrize("adapter", ["a", "b"])
def test_adapters_by_name_and_by_base_colon_name(
    cluster: ClusterHandle, client: openai.OpenAI, base: str, adapter: str
) -> None:
    want = greedy_native(cluster, adapter, messages=FRANCE)["text"]
    want_text = greedy_native(cluster, adapter, text="The quick brown fox")["text"]
    base_answers = (
        greedy_native(cluster, None, messages=FRANCE)["text"],
        greedy_native(cluster, None, text="The quick brown fox")["text"],
    )
    assert (want, want_text) != base_answers  # the adapter changes an answer
    for model in (adapter, f"{base}:{adapter}"):
        out = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=16)
        assert out.choices[0].message.content == want and out.model == model
        done = client.completions.create(model=model, prompt="The quick brown fox", temperature=0, max_tokens=16)
        assert done.choices[0].text == want_text


def test_streams_sync_and_async(cluster: ClusterHandle, client: openai.OpenAI, base: str) -> None:
    whole = client.chat.completions.create(model="a", messages=FRANCE, temperature=0, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model="a",
            messages=FRANCE,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", max_retries=0
        ) as ac:

            async def one(model: str) -> tuple[str, str]:
                kw = {"model": model, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 10}
                whole = await ac.completions.create(**kw)
                parts = [c.choices[0].text async for c in await ac.completions.create(stream=True, **kw) if c.choices]
                return whole.choices[0].text, "".join(parts)

            return await asyncio.gather(one(base), one("b"), one(f"{base}:a"))

    results = asyncio.run(run())
    assert all(whole == streamed for whole, streamed in results), results
    assert results[0][0] == greedy_native(cluster, None, text="Once upon a time")["text"][: len(results[0][0])]


def test_n_choices(client: openai.OpenAI, base: str) -> None:
    kw = {"model": base, "messages": FRANCE, "max_tokens": 8, "n": 3}
    greedy = client.chat.completions.create(temperature=0, **kw)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens % 3 == 0  # three identical choices
    sampled = client.chat.completions.create(temperature=1.0, seed=11, **kw)
    again = client.chat.completions.create(temperature=1.0, seed=11, **kw)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible choice by choice
    assert len(set(texts)) > 1  # ... and the choices differ (seeds seed, seed+1, seed+2)
    # the prompt is counted once, the completions of every choice
    one = client.chat.completions.create(temperature=0, **{**kw, "n": 1})
    assert sampled.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    streamed = list(client.completions.create(model=base, prompt=["Hi", "Hello"], n=2, max_tokens=4, stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1, 2, 3}


def test_stop_strings(client: openai.OpenAI, base: str) -> None:
    out = client.chat.completions.create(model=base, messages=FRANCE, temperature=0, max_tokens=16, stop=["Paris"])
    assert out.choices[0].message.content == "The capital of France is " and out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=base, messages=FRANCE, temperature=0, max_tokens=16, stop="Paris", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "The capital of France is "


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("model", ["never-loaded", "BASE:never-loaded"])
def test_never_loaded_adapter_is_404_with_loom_text(client: openai.OpenAI, base: str, model: str) -> None:
    model = model.replace("BASE", base)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=model, messages=FRANCE, max_tokens=4)
    assert "Got LoRA adapter that has never been loaded: never-loaded" in e.value.message
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        list(client.completions.create(model=model, prompt="x", max_tokens=4, stream=True))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"temprature": 0.5}}, "temprature"),
        ({"extra_body": {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}}, "messages[0].name"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI, base: str, kw: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=FRANCE, max_tokens=4, **kw)
    assert f"`{field}`" in e.value.message and e.value.body["param"] == field, e.value.body


def test_bad_values_are_400_with_openai_names(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=FRANCE, max_tokens=100000)
    assert "max_tokens" in e.value.message and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt="x", temperature=-1)
    assert "temperature" in e.value.message and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=base, messages=[{"role": "user"}], max_tokens=4)  # type: ignore[list-item]
    assert e.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=base, messages=FRANCE, top_logprobs=3)  # without logprobs=true


def test_adapter_names_that_would_make_model_ambiguous_are_refused(cluster: ClusterHandle, base: str) -> None:
    path = str(real_adapters()["r8-all"])
    for name in (base, " ", f"{base}:x", " a"):
        status, out = native(cluster, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert status == 400 and "LoRA adapter name" in json.dumps(out), (name, out)
    status, out = native(cluster, "/v1/models")
    ids = [m["id"] for m in out["data"]]
    assert status == 200 and ids.count(base) == 1 and " " not in ids, ids


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_match_transformers_fp32(
    cluster: ClusterHandle, client: openai.OpenAI, base: str, request: pytest.FixtureRequest
) -> None:
    probe = native(
        cluster,
        "/generate",
        {"text": "Hi", "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 1}},
    )[1]
    if probe["meta_info"].get("output_token_logprobs") is None:
        pytest.skip("the worker does not compute logprobs yet (meta_info.output_token_logprobs is None)")
    import torch
    from loom_helpers import DECODE_STEPS

    reference = request.getfixturevalue("reference")

    def expected(name: str) -> tuple[list[int], dict[int, torch.Tensor]]:
        ref = reference[name]
        steps = {0: ref["logits"], **{k: v for k, v in ref["step_logits"].items() if k in DECODE_STEPS}}
        return ref["greedy"], {k: torch.log_softmax(v.double(), -1) for k, v in steps.items()}

    def check(ids: list[int], token_lps: list[float], tops: list[list[tuple[float, int]]], name: str) -> None:
        greedy, lps = expected(name)
        n = min(len(ids), len(greedy))
        assert ids[:n] == greedy[:n]
        for k, lp in lps.items():
            if k >= n:
                continue
            assert abs(token_lps[k] - float(lp[greedy[k]])) < LOGPROB_TOL, (name, k)
            want = torch.topk(lp, 5)
            got = sorted(tops[k], reverse=True)
            assert [t for _, t in got] == want.indices.tolist(), (name, k)
            assert max(abs(v - float(w)) for (v, _), w in zip(got, want.values, strict=True)) < LOGPROB_TOL

    # native /generate on token ids (transformers' own tokenization of the prompt)
    raw = reference["raw_fox"]
    body = {
        "input_ids": raw["input_ids"],
        "return_logprob": True,
        "top_logprobs_num": 5,
        "sampling_params": {"temperature": 0, "max_new_tokens": len(raw["greedy"])},
    }
    meta = native(cluster, "/generate", body)[1]["meta_info"]
    pairs = meta["output_token_logprobs"]
    check([t for _, t in pairs], [v for v, _ in pairs], meta["output_top_logprobs"], "raw_fox")

    # the OpenAI chat API: the same numbers, with token strings
    name = "chat_france"
    n_new = len(reference[name]["greedy"])
    out = client.chat.completions.create(
        model=base, messages=FRANCE, temperature=0, max_tokens=n_new, logprobs=True, top_logprobs=5
    )
    content = out.choices[0].logprobs.content
    greedy, lps = expected(name)
    for k, lp in lps.items():
        if k < len(content):
            assert abs(content[k].logprob - float(lp[greedy[k]])) < LOGPROB_TOL
            assert len(content[k].top_logprobs) == 5
            assert abs(content[k].top_logprobs[0].logprob - float(lp.max())) < LOGPROB_TOL
    # ... and the completions API (legacy shape)
    done = client.completions.create(model=base, prompt=raw["input_ids"], temperature=0, max_tokens=4, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert abs(lp.token_logprobs[0] - float(expected("raw_fox")[1][0][raw["greedy"][0]])) < LOGPROB_TOL


# ----------------------------------------------------------------------------- metrics and health


def test_metrics_move_by_a_known_workload(cluster: ClusterHandle, client: openai.OpenAI, base: str) -> None:
    before = scrape(cluster)
    usages = []
    for model in (base, "a"):
        out = client.completions.create(
            model=model, prompt="Count to ten:", temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
        )
        usages.append(out.usage)
    stream = client.chat.completions.create(
        model="b",
        messages=FRANCE,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usages.append([c for c in stream][-1].usage)
    after = scrape(cluster)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loom_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("loom_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 16
    assert delta("loom_time_to_first_token_seconds_count") == 3
    assert delta("loom_inter_token_latency_seconds_count") == 16 - 3
    assert delta("loom_e2e_request_latency_seconds_count", finish_reason="length") == 3
    assert delta("loom_requests_total", finish_reason="length") == 3
    assert delta("loom_lora_requests_total", lora_name="a") == 1
    assert delta("loom_lora_requests_total", lora_name="b") == 1
    ok = {"outcome": "success", "status": "200"}
    assert delta("loom_http_requests_total", path="/v1/completions", **ok) == 2
    assert delta("loom_http_requests_total", path="/v1/chat/completions", **ok) == 1
    assert delta("loom_http_request_duration_seconds_count", path="/v1/completions", outcome="success") == 2
    assert client.models.retrieve("a").id == "a"  # a templated route is labelled by its template, not "unknown"
    after_get = scrape(cluster)
    key = ("loom_http_requests_total", tuple(sorted({"path": "/v1/models/{model:path}", **ok}.items())))
    assert after_get.get(key, 0.0) - before.get(key, 0.0) == 1
    # state gauges: residency of both adapters, vLLM's LoRA info for gateways
    tiers = {dict(k[1])["lora_name"]: dict(k[1])["tier"] for k in after if k[0] == "loom_lora_adapter_residency"}
    assert set(tiers) == {"a", "b"} and set(tiers.values()) <= {"slot", "host"}
    info = [dict(k[1]) for k, v in after.items() if k[0] == "vllm:lora_requests_info" and v > 0]
    # --max-loras-per-batch where adapters are copied into slots, --max-running-requests where the kernel reads
    # them in place (which one the start-up timing picks; both are checked in test_openai_units)
    assert info and info[0]["max_lora"] in ("4", "64"), info
    for name in ("vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc", "loom_num_requests_running"):
        assert (name, ()) in after, name
    assert after[("loom_healthy", ())] == 1


def test_prefix_cache_hits_are_reported_per_adapter(cluster: ClusterHandle, client: openai.OpenAI, base: str) -> None:
    """The same 120-token prompt twice under one adapter: the second reuses all but its last token (usage and
    native meta_info say so, the hit ratio moves, output is unchanged); under the other adapter nothing is reused."""
    prompt = list(range(1000, 1120))
    before = scrape(cluster)
    kw = {"prompt": prompt, "temperature": 0, "max_tokens": 4}
    first = client.completions.create(model="a", **kw)
    again = client.completions.create(model="a", **kw)
    other = client.completions.create(model="b", **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text
    body = {"input_ids": prompt, "lora_path": "a", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    status, out = native(cluster, "/generate", body)
    assert status == 200 and out["meta_info"]["cached_tokens"] == len(prompt) - 1
    after = scrape(cluster)
    got = after[("loom_prompt_tokens_cached_total", ())] - before.get(("loom_prompt_tokens_cached_total", ()), 0.0)
    assert got == 2 * (len(prompt) - 1)
    assert 0 < after[("loom_prefix_cache_hit_ratio", ())] <= 1


def test_health_is_503_while_a_worker_is_stopped(cluster: ClusterHandle) -> None:
    assert native(cluster, "/health") == (200, {"status": "ok"})
    pid = cluster.children["gpu_worker[0]"]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while (got := native(cluster, "/health"))[0] == 200:
            assert time.monotonic() < deadline, "the stopped worker was not noticed"
            time.sleep(0.25)
        assert got[0] == 503 and "TP rank 0" in got[1]["reason"], got
        assert native(cluster, "/health_generate")[0] == 503
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while native(cluster, "/health")[0] != 200:
        assert time.monotonic() < deadline, "the resumed worker was not noticed"
        time.sleep(0.25)
    status, out = native(cluster, "/health_generate")
    assert status == 200 and out["status"] == "ok"
