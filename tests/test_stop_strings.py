"""Stop strings: the scheduler finds them however many tokens they span, special-token stop strings match the
token, and streams never show text the final answer takes back (issue 9, item 2).

Unit tests drive ``StopStringMatcher``, ``StopText`` and an in-process front door + scheduler with scripted
tokens and the real SmolLM2 tokenizer; the ``slow`` tests send the issue's exact requests to a real cluster over
ZMQ and HTTP server-sent events.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket

import pytest
from loom_helpers import ListSink

from ipc.messages import (
    BatchTokenOut,
    ChatMessage,
    ClusterView,
    ErrorOut,
    GenerateOut,
    GenerateReq,
    SamplingParams,
    TokenizedReq,
)
from scheduler_proc.scheduler import Scheduler, StopStringMatcher
from tokenizer_proc.stop_text import StopText, first_match, hold_back_from
from tokenizer_proc.text import IncrementalText

IM_END = 2
FRANCE_TEXT = "The capital of France is"
# SmolLM2's greedy continuation of FRANCE_TEXT (fp32): " Paris.\n\nThe answer is: 2018-..."
FRANCE_OUT = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]
FRANCE_STOP = "\nThe answer"
# what each streamed chunk may show for FRANCE_OUT with FRANCE_STOP, and the final text
FRANCE_CHUNKS = [" Paris", " Paris.", " Paris.", " Paris.\n", " Paris.\n"]
FRANCE_FINAL = " Paris.\n"
CHAT_FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# greedy chat answer with ignore_eos: "The capital of France is Paris." then <|im_end|> at position 7
CHAT_OUT = [504, 3575, 282, 4649, 314, 7042, 30, IM_END, 198, IM_END, 1, 9690]
CJK = "語語語語語"  # 5 characters, 15 byte-level tokens


@pytest.fixture(scope="module")
def detok(text_codec):
    return lambda ids: text_codec.tok.decode(ids, skip_special_tokens=True)


def first_stop(matcher: StopStringMatcher, ids: list[int]) -> tuple[int, str] | None:
    """Feed ``ids`` one token at a time; (1-based token count, stop string) of the first match."""
    for n in range(1, len(ids) + 1):
        s = matcher.feed(ids[:n])
        if s is not None:
            return n, s
    return None


# ----------------------------------------------------------------------------- scheduler: StopStringMatcher


def test_stop_string_spanning_more_tokens_than_characters(text_codec, detok):
    ids = text_codec.encode(CJK)
    assert len(ids) == 15  # each 語 is three byte tokens
    assert first_stop(StopStringMatcher([CJK], detok, text_codec.special_tokens), ids + ids) == (15, CJK)
    # preceded by other text, and one character of it
    ids = text_codec.encode("hello " + CJK)
    assert first_stop(StopStringMatcher(["語", "x"], detok, {}), ids)[1] == "語"
    assert first_stop(StopStringMatcher([CJK], detok, {}), ids) == (len(ids), CJK)


def test_stop_string_after_many_special_tokens(text_codec, detok):
    """Skipped special tokens take no text: a window counted in tokens would lose the start of the match."""
    ids = text_codec.encode("\n") + [IM_END] * 40 + text_codec.encode("The answer")
    m = StopStringMatcher([FRANCE_STOP], detok, text_codec.special_tokens)
    assert first_stop(m, ids) == (len(ids), FRANCE_STOP)


def test_france_stop_matches_on_the_answer_token(text_codec, detok):
    m = StopStringMatcher([FRANCE_STOP], detok, text_codec.special_tokens)
    assert first_stop(m, FRANCE_OUT) == (6, FRANCE_STOP)


def test_special_token_stop_string_matches_the_token(text_codec, detok):
    specials = text_codec.special_tokens
    assert specials[IM_END] == "<|im_end|>"
    assert first_stop(StopStringMatcher(["<|im_end|>"], detok, specials), CHAT_OUT) == (8, "<|im_end|>")
    # a stop string with text around the special token matches the written-out text
    assert first_stop(StopStringMatcher([" Paris.<|im_end|>"], detok, specials), CHAT_OUT) == (8, " Paris.<|im_end|>")
    two = "<|im_end|>\n<|im_end|>"
    assert first_stop(StopStringMatcher([two], detok, specials), CHAT_OUT) == (10, two)
    # ordinary stop strings still see the text with special tokens skipped: "." then "\n" across <|im_end|>
    assert first_stop(StopStringMatcher([".\n"], detok, specials), CHAT_OUT) == (9, ".\n")
    # and "end|>" is not a special token's text: it never matches the written-out token
    assert first_stop(StopStringMatcher(["end|>"], detok, specials), CHAT_OUT) is None


def test_invalid_bytes_do_not_stall_matching(text_codec, detok):
    stray = text_codec.encode("語")[1]  # a lone UTF-8 continuation byte never completes a character
    for k in (6, 40):  # within and past the longest window the matcher keeps waiting for a character
        ids = [stray] * k + text_codec.encode(" stop here")
        n = k + len(text_codec.encode(" stop"))
        assert first_stop(StopStringMatcher(["stop"], detok, {}), ids) == (n, "stop")
    ids = text_codec.encode("a語")[:-1] + text_codec.encode("b stop")  # half a character, then text
    assert first_stop(StopStringMatcher(["b stop"], detok, {}), ids) == (len(ids), "b stop")


@pytest.mark.parametrize("seed", range(6))
def test_matches_exactly_where_the_full_decode_first_contains_the_stop(text_codec, detok, seed):
    """Random mixes of ASCII, CJK, emoji and special tokens: the incremental matcher stops at the first token
    whose full decode (special tokens skipped, or written out for special-token stop strings) holds the stop."""
    rng = random.Random(seed)
    pieces = [" the", " cat", "語", "日本", "🙂", "é", "\n", " 42", "<|im_end|>", "<|im_start|>", "ab"]
    text = "".join(rng.choice(pieces) for _ in range(60))
    ids = text_codec.encode(text)
    specials = text_codec.special_tokens
    for _ in range(8):
        i = rng.randrange(len(text) - 6)
        stop = text[i : i + rng.randint(1, 6)]
        written_out = any(t in stop for t in specials.values())
        full = [text_codec.decode(ids[:n], skip_special_tokens=not written_out) for n in range(len(ids) + 1)]
        want = next((n for n in range(1, len(ids) + 1) if stop in full[n]), None)
        got = first_stop(StopStringMatcher([stop], detok, specials), ids)
        assert (got[0] if got else None) == want, (stop, text)


def test_resumed_request_matches_across_the_delivered_tokens(text_codec, detok):
    s = Scheduler(
        max_running=2, kv_capacity=512, context_len=512, eos_ids=[IM_END], detokenize=detok,
        special_tokens=text_codec.special_tokens,
    )  # fmt: skip
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, stop=FRANCE_STOP)
    s.add(TokenizedReq("r", text_codec.encode(FRANCE_TEXT), sp, output_ids=FRANCE_OUT[:3], resume=True))
    outs = []
    for tok in FRANCE_OUT[3:]:
        assert s.next_batch() is not None
        outs += s.on_result([tok])
        if outs[-1].finished:
            break
    assert outs[-1].finish_reason.matched == FRANCE_STOP and outs[-1].completion_tokens == 6


# ----------------------------------------------------------------------------- front door: StopText


def test_hold_back_and_first_match():
    assert hold_back_from(" Paris.\n\nThe", [FRANCE_STOP]) == len(" Paris.\n")
    assert hold_back_from(" Paris.\n", [FRANCE_STOP]) == len(" Paris.")
    assert hold_back_from(" Paris.", [FRANCE_STOP]) == len(" Paris.")
    assert hold_back_from("abcab", ["abx", "bcabz"]) == 1  # the earliest possible start wins
    assert hold_back_from("xx stop yy s", ["stop"]) == 3  # a whole stop string is never shown either
    assert hold_back_from("", ["a"]) == 0 and hold_back_from("abc", []) == 3
    assert first_match("a stop b stop", ["b", "stop"]) == 2 and first_match("abc", ["x"]) == 3


def test_stop_text_special_token_positions(text_codec):
    ids = CHAT_OUT[:8]
    text = text_codec.decode(ids)
    assert text == "The capital of France is Paris."
    assert StopText(["<|im_end|>"], text_codec).final(text, ids) == text
    compound = StopText([" Paris.<|im_end|>"], text_codec)
    assert compound.final(text, ids) == "The capital of France is"
    assert compound.visible(text_codec.decode(ids[:7]), ids[:7]) == "The capital of France is"
    assert compound.visible(text_codec.decode(ids[:5]), ids[:5]) == "The capital of France is"
    after = StopText(["<|im_end|>\n<|im_end|>"], text_codec)
    assert after.visible(text_codec.decode(CHAT_OUT[:9]), CHAT_OUT[:9]) == text  # "\n" after the token: held
    assert after.final(text_codec.decode(CHAT_OUT[:10]), CHAT_OUT[:10]) == text


@pytest.mark.parametrize("seed", range(6))
def test_every_chunk_is_a_prefix_of_the_final_text(text_codec, detok, seed):
    """Random outputs and stop strings (plain and with special tokens), streamed token by token the way the front
    door does: each chunk that would be sent is a prefix of the final text."""
    rng = random.Random(100 + seed)
    pieces = [" the", " cat", "語", "🙂", "\n", "\n\n", " The", " answer", "<|im_end|>", "ab", "a", "."]
    for _ in range(10):
        ids = text_codec.encode("".join(rng.choice(pieces) for _ in range(40)))
        stops = [rng.choice(["\nThe answer", "a.a", "語🙂", "<|im_end|>", " cat<|im_end|>", "<|im_end|>\n", "zz"])]
        stops += rng.sample(["aaa", ". ", "\n\n\n"], rng.randint(0, 2))
        end = first_stop(StopStringMatcher(stops, detok, text_codec.special_tokens), ids)
        n = end[0] if end else len(ids)
        inc, st, chunks = IncrementalText(text_codec), StopText(stops, text_codec), []
        for k in range(n - 1):
            chunks.append(st.visible(inc.push([ids[k]]), ids[: k + 1]))
        final = inc.push(ids[n - 1 : n], final=True)
        final = st.final(final, ids[:n]) if end else final
        for c in chunks:
            assert final.startswith(c), (c, final, stops)
        assert all(a == b[: len(a)] for a, b in zip(chunks, chunks[1:], strict=False))  # only ever grows


# ----------------------------------------------------------------------------- front door + scheduler in process


class Pipeline:
    """A FrontDoor and a Scheduler wired together in one process; the model is a script of tokens."""

    def __init__(self, model_path, text_codec) -> None:
        from loom_helpers import make_args

        from tokenizer_proc.front_door import FrontDoor

        self.sent: list[object] = []
        self.door = FrontDoor(make_args(model_path), self.sent.append)
        self.detok = lambda ids: text_codec.tok.decode(ids, skip_special_tokens=True)
        self.door.on_cluster_view(ClusterView("sched-1", 1))
        self.sched = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            max_running=4, kv_capacity=2048, context_len=2048, eos_ids=[IM_END], detokenize=self.detok,
            special_tokens=self.door.codec.special_tokens,
        )  # fmt: skip

    def _to_scheduler(self) -> None:
        for m in self.sent:
            if isinstance(m, TokenizedReq):
                assert not self.sched.add(m)
        self.sent.clear()

    def run(self, req: GenerateReq, script: list[int], restart_after: int | None = None) -> list[object]:
        """Submit ``req``, answer each step with the next scripted token; optionally restart the scheduler
        (a new incarnation: the front door resubmits with the tokens delivered so far)."""
        sink = ListSink()
        asyncio.run(self.door.generate(req, sink))
        self._to_scheduler()
        pos = 0
        while self.sched.has_work:
            if pos == restart_after:
                self.sched = self._new_scheduler()
                self.door.on_cluster_view(ClusterView("sched-2", 1))
                self._to_scheduler()
                restart_after = None
                continue
            fb = self.sched.next_batch()
            outs = self.sched.on_result([script[pos]] * len(fb.reqs))
            pos += 1
            self.door.on_tokens(BatchTokenOut(outs))
        return sink.msgs


@pytest.fixture(scope="module")
def pipeline(model_path, text_codec):
    return Pipeline(model_path, text_codec)


def assert_prefix_stream(msgs: list[object]) -> tuple[list[str], GenerateOut]:
    assert msgs and all(isinstance(m, GenerateOut) for m in msgs), msgs
    final = msgs[-1]
    assert final.finished and not any(m.finished for m in msgs[:-1])
    chunks = [m.text for m in msgs[:-1]]
    for c in chunks:
        assert final.text.startswith(c), (c, final.text)
    return chunks, final


def test_stream_holds_back_a_possible_stop_string(pipeline):
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop=FRANCE_STOP)
    msgs = pipeline.run(GenerateReq(text=FRANCE_TEXT, sampling_params=sp, stream=True), FRANCE_OUT)
    chunks, final = assert_prefix_stream(msgs)
    assert chunks == FRANCE_CHUNKS
    assert final.text == FRANCE_FINAL and final.output_ids == FRANCE_OUT[:6]
    assert final.meta_info.finish_reason.matched == FRANCE_STOP


def test_stream_resumed_after_a_scheduler_restart(pipeline):
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop=FRANCE_STOP)
    req = GenerateReq(text=FRANCE_TEXT, sampling_params=sp, stream=True)
    msgs = pipeline.run(req, FRANCE_OUT, restart_after=3)
    chunks, final = assert_prefix_stream(msgs)
    assert chunks == FRANCE_CHUNKS and final.text == FRANCE_FINAL and final.output_ids == FRANCE_OUT[:6]
    assert final.meta_info.completion_tokens == 6


def test_unary_request_is_cut_and_length_finish_is_not(pipeline):
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop=FRANCE_STOP)
    (out,) = pipeline.run(GenerateReq(text=FRANCE_TEXT, sampling_params=sp), FRANCE_OUT)
    assert isinstance(out, GenerateOut) and out.text == FRANCE_FINAL
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, stop=FRANCE_STOP)
    msgs = pipeline.run(GenerateReq(text=FRANCE_TEXT, sampling_params=sp, stream=True), FRANCE_OUT)
    chunks, final = assert_prefix_stream(msgs)
    assert final.text == " Paris.\n\n" and final.meta_info.finish_reason.type == "length"  # nothing to cut


@pytest.mark.parametrize(
    ("stop", "n_tokens", "final_text"),
    [
        ("<|im_end|>", 8, "The capital of France is Paris."),
        (" Paris.<|im_end|>", 8, "The capital of France is"),
        (["zzz", "<|im_end|>\n<|im_end|>"], 10, "The capital of France is Paris."),
    ],
)
def test_special_token_stop_strings_through_the_front_door(pipeline, stop, n_tokens, final_text):
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=stop)
    req = GenerateReq(messages=[ChatMessage(**m) for m in CHAT_FRANCE], sampling_params=sp, stream=True)
    chunks, final = assert_prefix_stream(pipeline.run(req, CHAT_OUT))
    assert final.text == final_text and final.meta_info.completion_tokens == n_tokens
    assert final.meta_info.finish_reason.type == "stop"


def test_multibyte_stop_through_the_front_door(pipeline, text_codec):
    script = text_codec.encode("ab" + CJK * 2)
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, stop=CJK)
    msgs = pipeline.run(GenerateReq(text="x", sampling_params=sp, stream=True), script)
    chunks, final = assert_prefix_stream(msgs)
    assert final.text == "ab" and final.meta_info.completion_tokens == len(text_codec.encode("ab" + CJK))
    assert all("\ufffd" not in c for c in chunks)


def test_errors_pass_through(pipeline):
    sp = SamplingParams(max_new_tokens=99999, stop="x")
    (out,) = pipeline.run(GenerateReq(text="hi", sampling_params=sp, stream=True), [])
    assert isinstance(out, ErrorOut)


# ----------------------------------------------------------------------------- real model, real cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from loom_helpers import launch_cluster

    port = _free_port()
    flags = ("--http-port", str(port), "--max-total-tokens", "4096")
    with launch_cluster(tmp_path_factory.mktemp("stop"), *flags) as h:
        h.http_port = port  # type: ignore[attr-defined]
        yield h


def zmq_stream(cluster, **kw) -> tuple[list[str], dict]:
    with cluster.client() as c:
        outs = list(c.generate(stream=True, **kw))
    return [o["text"] for o in outs[:-1]], outs[-1]


def sse_stream(cluster, body: dict) -> tuple[list[str], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    try:
        conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200, r.read()
        events = []
        while line := r.readline():
            if line.startswith(b"data: "):
                events.append(line[len(b"data: ") :].strip().decode())
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    return [o["text"] for o in outs[:-1]], outs[-1]


def assert_chunks_are_prefixes(chunks: list[str], final: str) -> None:
    for c in chunks:
        assert final.startswith(c), f"chunk {c!r} is not a prefix of the final text {final!r}"


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["zmq", "sse"])
def test_real_stream_never_shows_text_the_stop_takes_back(cluster, wire):
    sp = {"temperature": 0, "max_new_tokens": 24, "stop": FRANCE_STOP}
    if wire == "zmq":
        chunks, final = zmq_stream(cluster, text=FRANCE_TEXT, sampling_params=sp)
    else:
        chunks, final = sse_stream(cluster, {"text": FRANCE_TEXT, "sampling_params": sp})
    assert final["text"] == FRANCE_FINAL
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": FRANCE_STOP}
    assert_chunks_are_prefixes(chunks, final["text"])
    assert chunks and not any("The" in c for c in chunks), chunks


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["zmq", "sse"])
def test_real_special_token_stop_string(cluster, wire):
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": "<|im_end|>"}
    if wire == "zmq":
        chunks, final = zmq_stream(cluster, messages=CHAT_FRANCE, sampling_params=sp)
    else:
        chunks, final = sse_stream(cluster, {"messages": CHAT_FRANCE, "sampling_params": sp})
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_end|>"}
    assert final["output_ids"][-1] == IM_END and final["meta_info"]["completion_tokens"] == 8
    assert final["text"] == "The capital of France is Paris."
    assert_chunks_are_prefixes(chunks, final["text"])


@pytest.mark.slow
def test_real_multibyte_stop_string(cluster, text_codec):
    prompt = "語" * 12
    with cluster.client() as c:
        free = c.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 24})
        assert CJK in free["text"], free  # the model repeats the character (precondition of the test)
        stopped = c.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 24, "stop": CJK})
    n = next(k for k in range(1, 25) if CJK in text_codec.decode(free["output_ids"][:k]))
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": CJK}
    assert stopped["meta_info"]["completion_tokens"] == n and n >= 15
    assert stopped["text"] == free["text"][: free["text"].index(CJK)]
    chunks, final = zmq_stream(
        cluster, text=prompt, sampling_params={"temperature": 0, "max_new_tokens": 24, "stop": CJK}
    )
    assert final["text"] == stopped["text"]
    assert_chunks_are_prefixes(chunks, final["text"])
