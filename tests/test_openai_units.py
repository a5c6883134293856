"""Unit tests without a cluster: OpenAI request decoding and refusal of unsupported fields, model names, logprob
formatting, the front door's logprob pass-through and drain refusal, and the health bookkeeping of the scheduler
(:mod:`scheduler_proc.health`) and the front door (:mod:`tokenizer_proc.health`)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
from loom_helpers import ListSink, make_args

from ipc.messages import (
    BatchTokenOut,
    ErrorOut,
    FinishReason,
    GenerateOut,
    GenerateReq,
    MetaInfo,
    SamplingParams,
    SchedulerBeat,
    TokenizedReq,
    TokenOut,
    WorkerPing,
)
from scheduler_proc import health as sched_health
from tokenizer_proc import openai_api as oa
from tokenizer_proc.health import ClusterHealth
from tokenizer_proc.http_io import HttpError


def decode_chat(body: dict) -> oa.ChatCompletionRequest:
    req = oa.decode_request(json.dumps(body).encode(), oa.ChatCompletionRequest)
    oa.check_supported(req)
    return req


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temprature": 1}, "temprature"),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages[0].tool_call_id"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_requests_refuse_fields_by_name(extra: dict, param: str) -> None:
    with pytest.raises(HttpError) as e:
        decode_chat({**CHAT, **extra})
    assert e.value.status == 400 and e.value.param == param, (e.value.message, e.value.param)


def test_neutral_values_of_unimplemented_fields_are_accepted() -> None:
    req = decode_chat(
        {
            **CHAT,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
            "user": "u1",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        }
    )
    assert oa.chat_messages(req) == [{"role": "system", "content": "a\nb"}]


@pytest.mark.parametrize("typ", [oa.ChatCompletionRequest, oa.CompletionRequest], ids=["chat", "completions"])
def test_null_is_every_optional_fields_default(typ) -> None:
    """OpenAI's schema types optional fields ``T | null``, and SDKs and proxies send unset ones as null (a new-user
    trial found ``logprobs``, ``stream``, ``echo`` and ``metadata`` refused)."""
    required = {
        "model": "m",
        **({"messages": CHAT["messages"]} if typ is oa.ChatCompletionRequest else {"prompt": "hi"}),
    }
    optional = [f.encode_name for f in msgspec.structs.fields(typ) if f.encode_name not in required]
    assert {"logprobs", "stream", "n", "ignore_eos"} <= set(optional)
    req = oa.decode_request(json.dumps({**required, **dict.fromkeys(optional)}).encode(), typ)
    plain = oa.decode_request(json.dumps(required).encode(), typ)
    assert req == plain
    oa.check_supported(req)


def test_a_full_queue_and_a_drain_have_their_own_503_codes() -> None:
    """Both are 503s, but a client retries a full queue soon and a draining server elsewhere: OpenAI's ``code``
    says which (``overloaded`` / ``unavailable``), as the native API's ``kind`` does."""
    from tokenizer_proc.openai_routes import _error_for

    full = json.loads(_error_for(ErrorOut("r", "server overloaded: 9 requests", "overloaded")).body)["error"]
    drain = json.loads(_error_for(ErrorOut("r", "Loom is shutting down", "unavailable")).body)["error"]
    assert (full["type"], full["code"], drain["code"]) == ("server_error", "overloaded", "unavailable")
    assert oa.error_detail(500, "bug", None).error.code is None


def test_completion_prompts_and_refusals() -> None:
    def prompts(p: object) -> list:
        req = oa.decode_request(json.dumps({"model": "m", "prompt": p}).encode(), oa.CompletionRequest)
        oa.check_supported(req)
        return oa.completion_prompts(req)

    assert prompts("x") == ["x"] and prompts(["x", "y"]) == ["x", "y"]
    assert prompts([1, 2]) == [[1, 2]] and prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "x"], [[]], [True]):
        with pytest.raises(HttpError):
            prompts(bad)
    for bad in (["x", ""], [[1, 2], []]):  # the empty one is named, whatever the prompts' form
        with pytest.raises(HttpError, match=r"prompt\[1\] is empty"):
            prompts(bad)
    for field, value in (("echo", True), ("suffix", "s"), ("best_of", 3), ("logprobs", 21)):
        with pytest.raises(HttpError) as e:
            oa.check_supported(oa.CompletionRequest(model="m", prompt="x", **{field: value}))
        assert e.value.param == field


def test_model_names() -> None:
    assert oa.resolve_model("base", "base", {"a"}, True) is None
    assert oa.resolve_model("a", "base", {"a"}, True) == "a"
    assert oa.resolve_model("base:a", "base", {"a"}, True) == "a"
    assert oa.resolve_model("base:a", "base", {"base:a"}, True) == "base:a"  # an adapter's own name wins
    assert oa.resolve_model("other", "base", set(), True) == "other"  # the front door answers never loaded
    with pytest.raises(HttpError) as e:  # another base's adapter: no adapter name holds a ':'
        oa.resolve_model("OtherBase:a", "base", {"a"}, True)
    assert e.value.status == 404 and "`OtherBase` is not this server's model `base`" in str(e.value)
    with pytest.raises(HttpError) as e:
        oa.resolve_model("a", "base", {"a"}, False)
    assert e.value.status == 404 and oa.error_detail(404, "x", e.value.param).error.code == "model_not_found"


def test_choices_get_their_own_seeds() -> None:
    req = oa.ChatCompletionRequest(model="m", messages=[], seed=5, n=3, temperature=0.5, stop="x")
    sps = [oa.sampling_params(req, 7, j) for j in range(3)]
    assert [sp.seed for sp in sps] == [5, 6, 7] and {sp.max_new_tokens for sp in sps} == {7}
    assert sps[0].temperature == 0.5 and sps[0].top_p == 1.0 and sps[0].stop == "x"
    assert oa.sampling_params(oa.CompletionRequest(model="m", prompt="x"), 3, 2).seed is None


def test_logprob_formatting() -> None:
    meta = MetaInfo(
        "r",
        3,
        2,
        FinishReason("length"),
        output_token_logprobs=[(-0.5, 10), (-1.5, 11)],
        output_top_logprobs=[[(-0.5, 10), (-2.0, 12)], [(-1.0, 12), (-1.5, 11)]],
    )

    def raw(t: int) -> bytes:
        return {10: b"Hel", 11: b"lo", 12: b" x"}[t]

    chat = oa.chat_logprobs(meta, 1, None, raw)
    assert chat is not None and [c.token for c in chat.content] == ["lo"]
    assert chat.content[0].top_logprobs[0].token == " x" and chat.content[0].bytes == list(b"lo")
    legacy = oa.completion_logprobs(meta, 0, True, raw)
    assert legacy is not None and legacy.tokens == ["Hel", "lo"] and legacy.text_offset == [0, 3]
    assert legacy.top_logprobs == [{"Hel": -0.5, " x": -2.0}, {" x": -1.0, "lo": -1.5}]
    assert oa.completion_logprobs(meta, 1, False, raw).text_offset == [3]  # a stream's later chunk
    assert oa.chat_logprobs(MetaInfo("r", 1, 1), 0, None, raw) is None
    assert oa.finish_reason(meta.finish_reason) == "length" and oa.finish_reason(FinishReason("stop")) == "stop"


def test_logprobs_of_pieces_of_a_character(model_path) -> None:
    """A character spread over several byte-level tokens: each token reports its real bytes (joined, they are the
    text), is named ``bytes:\\xNN`` while not whole UTF-8, distinct candidates keep distinct names, and text
    offsets count whole characters. Checked against the vocabulary itself, not against the code under test."""
    from tokenizers import Tokenizer

    from tokenizer_proc.token_bytes import TokenBytes, byte_level_chars

    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tb = TokenBytes(tok)
    text = "ok \U0001f31f\u6f22\u5b57 \u00e9!"  # an emoji, two CJK characters, an accented letter
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split()), "the test needs characters split over several tokens"
    assert b"".join(tb.bytes_of(t) for t in ids) == text.encode()
    assert tok.decode(ids) == text
    chars = byte_level_chars()
    assert len(chars) == 256 and sorted(chars.values()) == list(range(256))
    assert all(tb.bytes_of(t) == bytes(chars[c] for c in tok.id_to_token(t)) for t in ids)
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert partial, "no token of the text is a piece of a character"

    tops = [[(-0.1, t), (-0.2, partial[0]), (-0.3, partial[-1])] for t in ids]
    meta = MetaInfo("r", 1, len(ids), output_token_logprobs=[(-0.1, t) for t in ids], output_top_logprobs=tops)
    chat = oa.chat_logprobs(meta, 0, None, tb.bytes_of)
    assert bytes(b for c in chat.content for b in c.bytes) == text.encode()
    for c, t in zip(chat.content, ids, strict=True):
        raw = tb.bytes_of(t)
        try:
            assert c.token == raw.decode()
        except UnicodeDecodeError:
            assert c.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    legacy = oa.completion_logprobs(meta, 0, True, tb.bytes_of)
    if tb.bytes_of(partial[0]) != tb.bytes_of(partial[-1]):
        # distinct candidates keep distinct keys (before, all pieces were named U+FFFD and overwrote each other)
        assert all(
            len(top) == 3 or t in partial[::-1][:1] + partial[:1]
            for top, t in zip(legacy.top_logprobs, ids, strict=True)
        )
    # each token's offset: the characters of the text before the first character it has bytes of
    for k, off in enumerate(legacy.text_offset):
        before = b"".join(tb.bytes_of(t) for t in ids[:k])
        assert off == len(before.decode("utf-8", errors="ignore"))
    assert legacy.text_offset[-1] == len(text) - 1  # "!" is the last token
    # a stream feeds one counter chunk by chunk (never decoding earlier tokens again): the same offsets
    from tokenizer_proc.token_bytes import TextOffsets

    counter, streamed = TextOffsets(), []
    for start, end in ((0, 1), (1, 4), (4, len(ids))):
        part = MetaInfo("r", 1, end, output_token_logprobs=[(-0.1, t) for t in ids[:end]])
        streamed += oa.completion_logprobs(part, start, False, tb.bytes_of, counter).text_offset
    assert streamed == legacy.text_offset


# ----------------------------------------------------------------------------- the front door


def test_front_door_passes_logprobs_through_and_refuses_while_draining(model_path) -> None:
    from tokenizer_proc.front_door import FrontDoor

    async def run() -> None:
        sent: list[object] = []
        door = FrontDoor(make_args(model_path), sent.append)
        sink = ListSink()
        bad = GenerateReq(text="hi", top_logprobs_num=3)  # without return_logprob
        await door.generate(bad, sink)
        assert isinstance(sink.msgs[-1], ErrorOut) and "return_logprob" in sink.msgs[-1].message
        await door.generate(GenerateReq(text="hi", return_logprob=True, top_logprobs_num=21), sink)
        assert isinstance(sink.msgs[-1], ErrorOut) and "top_logprobs_num" in sink.msgs[-1].message

        req = GenerateReq(text="hi", return_logprob=True, top_logprobs_num=2, sampling_params=SamplingParams(3))
        await door.generate(req, sink)
        tr = sent[-1]
        assert isinstance(tr, TokenizedReq) and tr.return_logprob and tr.top_logprobs_num == 2
        n = len(tr.input_ids)
        top = [[(-0.1, 5), (-2.0, 6)]]
        door.on_tokens(
            BatchTokenOut([TokenOut(tr.rid, [5], n, 1, new_token_logprobs=[(-0.1, 5)], new_top_logprobs=top)])
        )
        # a resumed step repeats token 1: it is delivered (and its logprobs kept) once
        items = [TokenOut(tr.rid, [5, 7], n, 2, new_token_logprobs=[(-0.1, 5), (-0.3, 7)], new_top_logprobs=top * 2)]
        door.on_tokens(BatchTokenOut(items))
        fr = FinishReason("length")
        door.on_tokens(BatchTokenOut([TokenOut(tr.rid, [8], n, 3, True, fr, new_token_logprobs=[(-0.7, 8)])]))
        out = sink.msgs[-1]
        assert isinstance(out, GenerateOut) and out.finished and out.output_ids == [5, 7, 8]
        assert out.meta_info.output_token_logprobs == [(-0.1, 5), (-0.3, 7), (-0.7, 8)]
        assert out.meta_info.output_top_logprobs == top * 2  # the last step carried none
        m = door.metrics.registry
        assert m.get_sample_value("loom_generation_tokens_total") == 3
        assert m.get_sample_value("loom_time_to_first_token_seconds_count") == 1
        assert m.get_sample_value("loom_requests_total", {"finish_reason": "length"}) == 1

        door.begin_drain("shutting down")
        await door.generate(GenerateReq(text="hi"), sink)
        assert isinstance(sink.msgs[-1], ErrorOut) and sink.msgs[-1].kind == "unavailable"
        assert door.health.problem() == "shutting down"

    asyncio.run(run())


def test_lora_calls_in_flight_are_answered_when_the_front_door_stops(model_path) -> None:
    """A load waiting for the scheduler when the front door stops ends at once with ServerStopping (HTTP 503),
    and nothing is sent to undo it (the next front door adopts what the ranks then hold); later calls, and
    calls during a drain, are refused the same way."""
    from lora_helpers import real_adapters

    from ipc.messages import LoraLoadCmd, LoraUnloadCmd
    from tokenizer_proc.front_door import FrontDoor
    from tokenizer_proc.registry import ServerStopping

    path = str(real_adapters()["r8-all"])

    async def run() -> None:
        sent: list[object] = []
        door = FrontDoor(make_args(model_path, enable_lora=True), sent.append)
        load = asyncio.ensure_future(door.load_adapter("z", path))
        while not any(isinstance(m, LoraLoadCmd) for m in sent):
            await asyncio.sleep(0.01)
        door.lora.interrupt("the front door is restarting")
        with pytest.raises(ServerStopping, match=r"z: the load was cut short \(the front door is restarting\)"):
            await asyncio.wait_for(load, 5)
        assert not any(isinstance(m, LoraUnloadCmd) for m in sent) and door.registry.state("z") == "gone"
        with pytest.raises(ServerStopping, match="not loaded or unloaded now"):
            await door.load_adapter("y", path)
        n = len(sent)
        door.lora._unload_stray("uid-x", "x")  # e.g. a reconcile while it stops: nothing reaches the workers
        await asyncio.sleep(0.01)
        assert len(sent) == n

        drained = FrontDoor(make_args(model_path, enable_lora=True), sent.append)
        drained.begin_drain("Loom is shutting down")
        for call in (drained.load_adapter("y", path), drained.unload_adapter("y")):
            with pytest.raises(ServerStopping, match="Loom is shutting down: LoRA adapters are not loaded"):
                await call

    asyncio.run(run())


def test_the_eviction_counter_never_goes_back_across_a_front_door_restart() -> None:
    """A restarted front door shows the previous one's total until the scheduler's first beat says how much of it
    that scheduler still counts (/health may be 200 before it: a scrape then must not read a counter reset)."""
    h = ClusterHealth()
    h.restore_evictions(5, "s1", 3)
    assert h.slot_evictions == 5
    h.on_beat(SchedulerBeat("s1", 1, slot_evictions=4))  # the same scheduler counted one more since
    assert h.slot_evictions == 6
    h = ClusterHealth()
    h.restore_evictions(5, "s1", 3)
    h.on_beat(SchedulerBeat("s2", 1, slot_evictions=0))  # a new scheduler: all 5 are history
    assert h.slot_evictions == 5


# ----------------------------------------------------------------------------- health bookkeeping


def test_rank_liveness_probes_only_idle_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    live = sched_health.RankLiveness(2)
    ids = iter(range(-100, -200, -1))
    assert live.probe(lambda: next(ids), busy=True) is None
    probe = live.probe(lambda: next(ids), busy=False)
    assert probe is not None and isinstance(probe, WorkerPing) and live.owns(probe.op_id)
    assert live.probe(lambda: next(ids), busy=False) is None  # one in flight at a time
    live.on_probe_ack(0)
    assert live.unresponsive() == {}
    monkeypatch.setattr(sched_health, "PROBE_TIMEOUT_S", 0.0)
    assert list(live.unresponsive()) == [1] and "TP rank 1" in live.unresponsive()[1]
    live.on_probe_ack(1)
    assert live.unresponsive() == {} and not live.owns(probe.op_id)
    live.probe_op = -5
    live.reset()  # a new TP group: the old probe is void
    assert live.unresponsive() == {} and len(live.silence()) == 2


def test_a_replacement_groups_stuck_clock_starts_at_its_own_first_ready() -> None:
    """The scheduler's start-up wait: a rank silent ``--step-timeout`` after another rank *of its epoch* said
    READY is stuck. Epoch 5's clock must not start at epoch 4's READY (that once declared every replacement group
    hung the moment one of its ranks was up, until the launcher gave up after 5 restarts)."""
    fr = sched_health.FirstReady()
    fr.seen(4, 100.0)
    fr.seen(4, 101.0)  # a second rank of epoch 4: the clock keeps the first
    assert fr.waited(4, 105.0) == 5.0
    fr.seen(5, 110.0)
    assert fr.waited(5, 110.5) == 0.5  # not 10.5 (since epoch 4's first READY)
    assert fr.waited(6, 120.0) == 0.0  # no READY of epoch 6 seen yet: its clock starts now
    assert fr.waited(6, 121.0) == 1.0


def test_a_rank_silent_after_a_peer_that_ran_steps_answered_is_stuck_sooner() -> None:
    """A peer that ran steps of its group proves every rank started, so a rank still silent is inside a step (its
    peers leave it within moments) or stuck in one they never got: stuck after PEER_SKEW_S, not --step-timeout.
    Ranks that answer without steps (a group just started, one rank still loading) keep the whole timeout."""
    fr = sched_health.FirstReady()
    fr.seen(3, 100.0)  # a fresh rank of epoch 3 (no steps yet): the other may still be loading
    assert not fr.stuck(3, 100.0 + sched_health.PEER_SKEW_S + 1, 20.0)
    assert fr.stuck(3, 120.5, 20.0)
    fr.seen(4, 200.0, steps=12)  # a rank of epoch 4 that had run 12 steps
    assert not fr.stuck(4, 200.0 + sched_health.PEER_SKEW_S - 0.1, 20.0)
    assert fr.stuck(4, 200.0 + sched_health.PEER_SKEW_S + 0.1, 20.0)
    fr.seen(5, 300.0, steps=1)
    assert fr.stuck(5, 302.5, 2.0)  # a --step-timeout shorter than PEER_SKEW_S still rules


def test_slot_evictions_are_counted_per_slot() -> None:
    assert sched_health.count_evictions({"a": 0, "b": 1}, {"c": 0, "b": 1}) == 1
    assert sched_health.count_evictions({"a": 0, "b": 1}, {"b": 1}) == 0  # unloaded: the slot is empty
    assert sched_health.count_evictions({}, {"a": 0}) == 0


def test_cluster_health_reasons_and_evictions_across_schedulers() -> None:
    h = ClusterHealth(silence_limit_s=0.2)
    assert h.problem() is None
    h.on_beat(SchedulerBeat("s1", 1, [0.1], {0: "TP rank 0 has not answered"}, slot_evictions=2))
    assert h.problem() == "TP rank 0 has not answered"
    h.on_beat(SchedulerBeat("s2", 1, [0.1], slot_evictions=1))  # a restarted scheduler counts from zero
    assert h.problem() is None and h.slot_evictions == 3
    time.sleep(0.25)
    assert "no heartbeat" in (h.problem() or "")
    h.heard_from_scheduler()
    h.unavailable = "TP group restarting"
    assert h.problem() == "TP group restarting"
    h.restarting = "the front door is restarting"  # a dying front door: /health 503 until its successor answers
    assert h.problem() == "the front door is restarting"


# ----------------------------------------------------------------------------- refusals name OpenAI's fields


def test_seed_range_with_n_is_refused_not_wrapped() -> None:
    top = oa.MAX_SEED
    assert top == 2**63 - 1
    with pytest.raises(HttpError) as e:
        decode_chat({**CHAT, "seed": top - 1, "n": 3})
    assert e.value.status == 400 and e.value.param == "seed" and str(top) in e.value.message
    for seed in (-1, top + 1):
        with pytest.raises(HttpError) as e:
            decode_chat({**CHAT, "seed": seed})
        assert e.value.param == "seed"
    req = decode_chat({**CHAT, "seed": top - 2, "n": 3})  # the last choice gets exactly the largest seed
    assert [oa.sampling_params(req, 1, j).seed for j in range(3)] == [top - 2, top - 1, top]
    assert decode_chat({**CHAT, "seed": top}).seed == top


def test_adapter_names_are_checked_by_one_function() -> None:
    from ipc.lora_config import adapter_name_problem
    from tokenizer_proc.registry import AdapterRefused, LoraRegistry

    base = "SmolLM2-135M-Instruct"
    for name, words in (
        ("", "empty"),
        ("   ", "empty or only whitespace"),
        (" a", "leading or trailing whitespace"),
        ("a\t", "leading or trailing whitespace"),
        ("a/b", "'/'"),
        ("a:b", "separates BASE:ADAPTER"),
        ("com,ma", "contains ','"),
        ("new\nline", "non-printable character U+000A"),
        ("zero\u200bwidth", "non-printable character U+200B"),
        (".", "path step"),
        ("..", "path step"),
        ("x" * 129, "at most 128"),
        (base, "served model's name"),
    ):
        problem = adapter_name_problem(name, base)
        assert problem is not None and words in problem, (name, problem)
        with pytest.raises(AdapterRefused, match="LoRA adapter name"):
            LoraRegistry(served_model_name=base).check_adapter(name, "/nonexistent")
    assert adapter_name_problem("my-adapter_2.v1", base) is None
    assert adapter_name_problem("x" * 128, base) is None and adapter_name_problem("é-adapter", base) is None
    assert adapter_name_problem(base, "") is None  # no served name known: nothing to clash with


def test_unusable_adapter_paths_are_refused_by_name(tmp_path) -> None:
    """A path the file system cannot take (a NUL byte, a name over NAME_MAX) is the caller's error, named, with
    and without --lora-root: it used to escape as an internal error (HTTP 500)."""
    from tokenizer_proc.registry import AdapterRefused, LoraRegistry

    for root in ("", str(tmp_path)):
        reg = LoraRegistry(lora_root=root)
        with pytest.raises(AdapterRefused, match="LoRA adapter a: path .* contains a NUL character"):
            reg.check_adapter("a", str(tmp_path / "x\x00y"))
        with pytest.raises(AdapterRefused, match="LoRA adapter a: .*(cannot be used|is not a folder)"):
            reg.check_adapter("a", str(tmp_path / ("n" * 5000)))
        for empty in ("", "  "):  # resolved, it named the working directory as outside the root
            with pytest.raises(AdapterRefused, match="LoRA adapter a: the path is empty"):
                reg.check_adapter("a", empty)


def test_every_load_entry_point_refuses_bad_adapter_names(model_path) -> None:
    """HTTP ``/load_lora_adapter``, ZMQ ``LoadLoraReq`` and ``--lora-paths`` all load through
    ``FrontDoor.load_adapter``; a bad name is refused there before anything reaches the scheduler."""
    from tokenizer_proc.front_door import FrontDoor
    from tokenizer_proc.registry import AdapterRefused

    async def run() -> None:
        sent: list[object] = []
        door = FrontDoor(make_args(model_path, enable_lora=True), sent.append)
        for name in ("SmolLM2-135M-Instruct", " ", "", " x ", "SmolLM2-135M-Instruct:x"):
            with pytest.raises(AdapterRefused, match="LoRA adapter name"):
                await door.load_adapter(name, str(model_path))
        named = FrontDoor(make_args(model_path, enable_lora=True, served_model_name="served"), sent.append)
        with pytest.raises(AdapterRefused, match="served model's name"):
            await named.load_adapter("served", str(model_path))
        assert not sent and not door.registry.refs and not named.registry.refs

    asyncio.run(run())


async def _call(routes, path: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to one of ``routes``'s endpoints in process: (status, JSON body)."""
    from starlette.requests import Request

    from tokenizer_proc.http_io import guarded
    from tokenizer_proc.openai_routes import error_response

    data = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    fn = routes.chat if path.endswith("chat/completions") else routes.completions
    resp = await asyncio.wait_for(guarded(error_response)(fn)(Request(scope, receive)), 30)
    return resp.status_code, json.loads(resp.body)


BASE = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "hi"}]
_CHAT_400 = [
    ({"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content is required"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, "messages[1].content", "required"),
    ({"messages": []}, "messages", "messages is empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "messages[0].role='wizard'"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0 must be in [1, 2048]"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens=-1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0"),
    ({"max_tokens": 5000}, "max_tokens", "max_tokens=5000 must be in [1, 2048]"),
    ({"temperature": -1}, "temperature", "temperature=-1"),
    ({"temperature": 101}, "temperature", "temperature=101"),
    ({"top_p": 0}, "top_p", "top_p=0"),
    ({"top_k": 0}, "top_k", "top_k=0"),
    ({"seed": -1}, "seed", "seed=-1"),
    ({"seed": 2**63 - 2, "n": 3}, "seed", "9223372036854775807"),
    ({"stop": ""}, "stop", "stop"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids", "outside the vocabulary"),
    ({"model": ""}, "model", "model='' is empty"),
    ({"model": " "}, "model", "is empty"),
    ({"model": BASE + ":"}, "model", "names no adapter after"),
]


@pytest.fixture(scope="module")
def refusing_doors(model_path):
    """One front door without and one with --enable-lora, shared by the 400 tests below (building one loads the
    tokenizer): {enable_lora: (door, what it sent the scheduler)}. Each test checks that its refused request left
    nothing sent, pending or counted, so a shared door cannot hide a leak; it proves one."""
    from tokenizer_proc.front_door import FrontDoor

    doors = {}
    for lora in (False, True):
        sent: list[object] = []
        doors[lora] = (FrontDoor(make_args(model_path, enable_lora=lora), sent.append), sent)
    yield doors
    for door, _ in doors.values():
        door._tokenizer_thread.shutdown(wait=True)


def _assert_nothing_reached_the_scheduler(door, sent: list[object]) -> None:
    assert not sent  # refused before anything reached the scheduler
    assert not door.pending and not door.by_client and not door.intake and door.tokenizing == 0


@pytest.mark.parametrize(("extra", "param", "words"), _CHAT_400)
def test_chat_400s_name_the_openai_field(refusing_doors, extra: dict, param: str, words: str) -> None:
    from tokenizer_proc.openai_routes import OpenAIRoutes

    async def run() -> None:
        for lora in (False, True):
            door, sent = refusing_doors[lora]
            routes = OpenAIRoutes(door)
            status, out = await _call(routes, "/v1/chat/completions", {"model": BASE, "messages": USER, **extra})
            err = out["error"]
            assert status == 400 and err["param"] == param and words in err["message"], (lora, out)
            assert "max_new_tokens" not in err["message"] and "lora_path" not in err["message"]
            assert "sampling_params" not in err["message"]
            _assert_nothing_reached_the_scheduler(door, sent)

    asyncio.run(run())


_COMPLETION_400 = [
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt", "prompt[1] is empty"),
    ({"prompt": [1, 10**9]}, "prompt", "prompt[1]=1000000000 is outside the vocabulary"),
    ({"prompt": [-1]}, "prompt", "prompt[0]=-1 is outside the vocabulary"),
    ({"prompt": [[1], [2, 10**9]]}, "prompt", "prompt[1][1]=1000000000"),
    ({"prompt": [1] * 2040}, "prompt", "prompt (2040 tokens) + max_tokens (16) exceeds the context length 2048"),
    ({"prompt": [1] * 2047, "max_tokens": 2}, "prompt", "prompt (2047 tokens) + max_tokens (2)"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"temperature": 101}, "temperature", "temperature=101"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"model": ""}, "model", "is empty"),
]


@pytest.mark.parametrize(("extra", "param", "words"), _COMPLETION_400)
def test_completion_400s_name_the_openai_field(refusing_doors, extra: dict, param: str, words: str) -> None:
    from tokenizer_proc.openai_routes import OpenAIRoutes

    async def run() -> None:
        door, sent = refusing_doors[False]
        routes = OpenAIRoutes(door)
        status, out = await _call(routes, "/v1/completions", {"model": BASE, "prompt": "hi", **extra})
        err = out["error"]
        assert status == 400 and err["param"] == param and words in err["message"], out
        assert "max_new_tokens" not in err["message"] and "input_ids" not in err["message"]
        _assert_nothing_reached_the_scheduler(door, sent)

    asyncio.run(run())


def test_context_length_errors_say_max_tokens_and_its_value(model_path) -> None:
    from tokenizer_proc.front_door import FrontDoor
    from tokenizer_proc.openai_routes import OpenAIRoutes

    async def run() -> None:
        sent: list[object] = []
        door = FrontDoor(make_args(model_path), sent.append)
        routes = OpenAIRoutes(door)
        long_chat = [{"role": "user", "content": "hello " * 2100}]  # over 2048 tokens, few enough characters
        status, out = await _call(routes, "/v1/chat/completions", {"model": BASE, "messages": long_chat})
        msg = out["error"]["message"]
        assert status == 400 and out["error"]["param"] == "messages", out
        assert "leaves no room" in msg and "max_tokens was not given" in msg and "max_new_tokens" not in msg

        body = {"model": BASE, "messages": long_chat, "max_tokens": 7}
        status, out = await _call(routes, "/v1/chat/completions", body)
        assert status == 400 and "+ max_tokens (7) exceeds the context length 2048" in out["error"]["message"]

        huge = "x" * (2048 * door.codec.max_token_chars + 1)  # refused by its length before it is tokenized
        status, out = await _call(routes, "/v1/completions", {"model": BASE, "prompt": huge, "max_tokens": 2})
        msg = out["error"]["message"]
        assert status == 400 and out["error"]["param"] == "prompt" and "minus max_tokens (2)" in msg, out
        status, out = await _call(
            routes, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": huge}]}
        )
        msg = out["error"]["message"]
        assert status == 400 and out["error"]["param"] == "messages" and "minus max_tokens (1)" in msg, out
        assert "max_tokens was not given" in msg
        assert not sent

    asyncio.run(run())


def test_more_choices_than_the_server_ever_queues_is_a_400_not_a_503() -> None:
    from types import SimpleNamespace

    from tokenizer_proc.http_io import HttpError
    from tokenizer_proc.openai_routes import OpenAIRoutes

    routes = OpenAIRoutes.__new__(OpenAIRoutes)
    routes.door = SimpleNamespace(max_queued=3)
    routes._check_choices(3, "n=3")
    with pytest.raises(HttpError) as e:
        routes._check_choices(4, "n=4")
    assert e.value.status == 400 and "n=4 asks for 4 generations" in str(e.value)
    assert "--max-queued-requests 3" in str(e.value)


def test_front_door_metrics_carry_over_a_restart(tmp_path) -> None:
    """A restarted front door (same cluster folder) exposes the old one's counters and histograms plus its own,
    label sets only the old one saw included; the launcher's restart counts are not doubled; slot evictions go
    on from the old total, counting the still-running scheduler's own count once."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from tokenizer_proc.metrics import Metrics
    from tokenizer_proc.registry import LoraRegistry

    def door():
        args = make_args(".", enable_lora=True, max_loras_per_batch=4)
        eps = msgspec.structs.replace(args.endpoints, socket_dir=str(tmp_path))  # the cluster's folder
        args = msgspec.structs.replace(args, endpoints=eps)
        d = SimpleNamespace(pending={}, health=ClusterHealth(), args=args, registry=LoraRegistry())
        m = Metrics()
        m.watch(d)
        return d, m

    def scrape(m) -> dict:
        fams = text_string_to_metric_families(m.exposition().decode())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}

    def beat(incarnation: str, evictions: int) -> SchedulerBeat:
        return SchedulerBeat(incarnation, 1, slot_evictions=evictions)

    d1, m1 = door()
    m1.request_submitted(10, "a")
    m1.tokens_delivered(5, 0.2, None)
    m1.request_finished(1.0, "length")
    d1.health.merge_restarts({"tokenizer_proc": 1})
    d1.health.adapters_lost += 2
    d1.health.on_beat(beat("s1", 3))
    old = scrape(m1)
    assert old[("loom_prompt_tokens_total", ())] == 10 and old[("loom_lora_slot_evictions_total", ())] == 3

    d2, m2 = door()  # the launcher restarts the front door; the scheduler s1 still runs
    d2.health.merge_restarts({"tokenizer_proc": 2})
    d2.health.on_beat(beat("s1", 4))
    m2.request_submitted(7, None)
    m2.request_finished(0.5, "stop")
    new = scrape(m2)
    assert new[("loom_prompt_tokens_total", ())] == 17 and new[("loom_generation_tokens_total", ())] == 5
    assert new[("loom_lora_requests_total", (("lora_name", "a"),))] == 1  # a label set only the old one saw
    assert new[("loom_requests_total", (("finish_reason", "length"),))] == 1
    assert new[("loom_requests_total", (("finish_reason", "stop"),))] == 1
    assert new[("loom_e2e_request_latency_seconds_count", (("finish_reason", "length"),))] == 1
    assert new[("loom_lora_adapters_lost_total", ())] == 2
    assert new[("loom_process_restarts_total", (("process", "tokenizer_proc"),))] == 2  # the launcher's count
    assert new[("loom_lora_slot_evictions_total", ())] == 4  # 3 seen before, 1 more by the same scheduler
    assert all(new.get(k, -1) >= v for k, v in old.items() if "restarts" not in k[0]), "a sample went back"

    d3, m3 = door()  # the front door and the scheduler both restarted
    d3.health.on_beat(beat("s2", 1))
    assert scrape(m3)[("loom_lora_slot_evictions_total", ())] == 5

    (tmp_path / "front-door-metrics.json").write_text("{torn")
    _, m4 = door()  # a torn file: start from zero, never fail
    assert scrape(m4)[("loom_prompt_tokens_total", ())] == 0


def test_a_client_that_leaves_mid_body_is_not_a_server_error(caplog) -> None:
    """A body cut short by the client's disconnect answers 499 (nobody to answer), logged as no bug."""
    import logging

    from starlette.requests import Request

    caplog.set_level(logging.INFO)
    from tokenizer_proc.http_io import guarded
    from tokenizer_proc.openai_routes import error_response

    msgs = [{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        return msgs.pop(0)

    async def endpoint(request: Request):
        await request.body()
        raise AssertionError("the body cannot arrive")

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [], "query_string": b""}
    resp = asyncio.run(guarded(error_response)(endpoint)(Request(scope, receive)))
    assert resp.status_code == 499
    assert "the client disconnected before its body arrived" in caplog.text and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_max_lora_says_how_many_adapters_one_batch_can_mix(tmp_path) -> None:
    """vllm:lora_requests_info's max_lora: --max-loras-per-batch where the workers copy adapters into slots, the
    running batch's size where they read them in place (the pools' READY rows say which), the flag before any
    heartbeat."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from ipc.lora_config import lora_rows
    from scheduler_proc.health import batch_stats
    from scheduler_proc.scheduler import Scheduler
    from tokenizer_proc.metrics import Metrics
    from tokenizer_proc.registry import LoraRegistry

    args = make_args(".", enable_lora=True, max_loras_per_batch=2)
    d = SimpleNamespace(pending={}, health=ClusterHealth(), args=args, registry=LoraRegistry())
    m = Metrics()
    m.watch(d)

    def max_lora() -> str:
        fams = text_string_to_metric_families(m.exposition().decode())
        (label,) = [s.labels["max_lora"] for f in fams for s in f.samples if s.name == "vllm:lora_requests_info"]
        return label

    assert max_lora() == "2"  # no heartbeat yet
    common = {"max_running": 16, "kv_capacity": 1000, "context_len": 512, "eos_ids": [2], "max_loras_per_batch": 2}
    copied = Scheduler(**common, max_lora_rank=64)
    in_place = Scheduler(**common, max_lora_rank=64, lora_pool_rows=(2 + 16 - 1) * lora_rows(64))
    for sched, want in ((copied, "2"), (in_place, "16")):
        d.health.on_beat(SchedulerBeat("s1", 1, **batch_stats(sched)))
        assert max_lora() == want
