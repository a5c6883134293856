"""The wire codec: every message of every edge round-trips; bad frames raise WireError naming the problem."""

from __future__ import annotations

import typing

import msgspec
import pytest

from ipc import messages as m
from ipc.codec import Codec, WireError

SP = m.SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=40, stop=["\n", "END"], seed=3)
META = m.MetaInfo("c1", 5, 2, m.FinishReason("stop", matched=2), "adapter-a")
WS = m.WorkerSampling(0.7, 0.95, 50, 11)

SAMPLES = {
    "ClientMsg": [
        m.GenerateReq(text="hi", sampling_params=SP, stream=True, lora_path="a", rid="r1"),
        m.GenerateReq(input_ids=[1, 2, 3]),
        m.GenerateReq(messages=[m.ChatMessage("user", "hello")], sampling_params=m.SamplingParams(stop="x")),
        m.AbortReq("r1"),
        m.LoadLoraReq("a", "/tmp/a", pinned=True),
        m.UnloadLoraReq("a"),
        m.ListLorasReq(),
        m.HealthReq(),
    ],
    "ServerMsg": [
        m.GenerateOut("r1", "text", [4, 5], META, True),
        m.GenerateOut("r1", "", [], m.MetaInfo("r1", 3, 0), False),
        m.ErrorOut("r1", "bad", "not_found"),
        m.AdminOut(True, "ok", {"running": 3, "nested": {"x": [1, 2]}}),
        m.LoraListOut([m.AdapterInfo("a", "uid-a", "/p", 8, False, {"rank 0": 1})]),
    ],
    "ToSchedulerMsg": [
        m.TokenizedReq("r", [1, 2], SP, "uid", True),
        m.AbortRid("r", "client disconnected"),
        m.LoraLoadCmd(1, "uid", "a", "/p", True),
        m.LoraUnloadCmd(2, "uid"),
        m.LoraSlotsQuery(3),
        m.ShutdownCmd(),
        m.WorkersRestarting(2, "gpu_worker[1] exited with code -9 (SIGKILL)", "gpu_worker[1]", {"gpu_worker[1]": 1}),
        m.FrontDoorHello("abc"),
        m.TokenizedReq("r", [1, 2], SP, None, False, [5, 6], True),
    ],
    "ToTokenizerMsg": [
        m.BatchTokenOut([m.TokenOut("r", [1], 3, 1), m.TokenOut("s", [2], 4, 5, True, m.FinishReason("length"))]),
        m.BatchTokenOut([m.TokenOut("r", [], 3, 0, True, m.FinishReason("abort", message="x"), error="x")]),
        m.LoraOpResult(1, False, "boom", {"uid": {"rank 0": 0, "rank 1": 0}}),
        m.ClusterEvent("workers_restarting", "gpu_worker[1] died", epoch=2, process="gpu_worker[1]"),
        m.ClusterView("inc", 2, [m.AdapterState("u", "a", "/p", True, "ab" * 32)], {"scheduler_proc": 1}),
        m.ClusterEvent(
            "workers_recovered", "ok", epoch=2, resumed=3, restored=["a"], lost=[m.LostAdapter("u", "b", "gone")]
        ),
        m.SchedulerBeat("inc", 2, [0.1, 0.2], {1: "silent"}, running=3, running_lora_uids=["u"], slot_evictions=4),
        m.DrainCmd(30.0),
        m.BatchTokenOut([m.TokenOut("r", [7], 3, 1, new_token_logprobs=[(-0.5, 7)], new_top_logprobs=[[(-0.5, 7)]])]),
    ],
    "ToWorkerMsg": [
        m.ForwardBatch(
            3, [m.BatchReq("r", 0, [1, 2], 0, [7, 8], None, WS), m.BatchReq("s", 1, [9], 4, [3], "u", WS, 2)]
        ),
        m.WorkerLoraLoad(1, "uid", "a", "/p"),
        m.WorkerLoraLoad(-2, "uid", "a", "/p", True, content_hash="ab" * 32),
        m.WorkerLoraUnload(2, "uid", rollback=True),
        m.WorkerShutdown(),
        m.SchedulerHello("inc"),
        m.WorkerPing(7),
        m.ForwardBatch(4, [m.BatchReq("r", 0, [1], 2, [9], None, WS, 1, 5)]),
    ],
    "FromWorkerMsg": [
        m.WorkerReady(1, "inc", 4096, ["u"]),
        m.WorkerReady(0, "inc", 4096, ["u"], epoch=3, adapters=[m.AdapterState("u", "a", "/p", False, "h")]),
        m.StepResult(3, 0, [5, 6], "digest", {"u": 0}),
        m.StepResult(3, 1, [], error="rank 1: boom"),
        m.LoraOpAck(1, 0, False, "bad"),
        m.LoraOpAck(1, 1, True, content_hash="cd" * 32, epoch=2),
        m.WorkerPong(7, 1, epoch=2),
        m.StepResult(4, 0, [7], logprobs={0: m.RowLogprobs(-0.25, [(-0.25, 7), (-2.0, 3)])}),
    ],
    "ControlMsg": [
        m.ProcReady("scheduler_proc", 123, {"kv_tokens": 10}),
        m.ProcFailed("gpu_worker[1]", 5, "oom"),
        m.RestartWorkers(1, "step timed out"),
        m.Heartbeat("scheduler_proc", 42),
    ],
}
UNIONS = {name: getattr(m, name) for name in SAMPLES}


def test_every_union_member_has_a_sample():
    for name, union in UNIONS.items():
        members = set(typing.get_args(union))
        assert members == {type(x) for x in SAMPLES[name]}, name


@pytest.mark.parametrize("union", sorted(SAMPLES))
def test_round_trip(union):
    codec = Codec(UNIONS[union])
    for msg in SAMPLES[union]:
        frame = codec.encode(msg)
        assert isinstance(frame, bytes)
        back = codec.decode(frame)
        assert type(back) is type(msg)
        assert back == msg
        assert codec.decode(memoryview(frame)) == msg


def test_no_pickle_on_the_wire():
    frame = Codec(m.ClientMsg).encode(SAMPLES["ClientMsg"][0])
    assert msgspec.msgpack.decode(frame)["type"] == "GenerateReq"  # plain msgpack map with a tag


@pytest.mark.parametrize("union", sorted(SAMPLES))
@pytest.mark.parametrize(
    "garbage", [b"", b"\xc1", b"\xc1\xc1\xc1\xc1", b"\x92\x01", b"\x00garbage", b"not msgpack at all"]
)
def test_garbled_bytes_raise_wire_error(union, garbage):
    with pytest.raises(WireError):
        Codec(UNIONS[union]).decode(garbage)


@pytest.mark.parametrize("union", sorted(SAMPLES))
def test_truncated_frames_raise_wire_error(union):
    codec = Codec(UNIONS[union])
    for msg in SAMPLES[union]:
        frame = codec.encode(msg)
        for cut in {1, len(frame) // 2, len(frame) - 1}:
            if 0 < cut < len(frame):
                with pytest.raises(WireError, match=r"malformed frame \(\d+ bytes\)|invalid message"):
                    codec.decode(frame[:cut])


def test_truncated_message_is_named_truncated():
    codec = Codec(m.ClientMsg)
    frame = codec.encode(m.GenerateReq(text="hello there", rid="abc"))
    with pytest.raises(WireError, match="truncated"):
        codec.decode(frame[:-3])


@pytest.mark.parametrize("src", sorted(SAMPLES))
@pytest.mark.parametrize("dst", sorted(SAMPLES))
def test_another_edges_message_is_a_wrong_tag(src, dst):
    if src == dst:
        return
    enc = Codec(UNIONS[src])
    dec = Codec(UNIONS[dst])
    for msg in SAMPLES[src]:
        with pytest.raises(WireError, match="invalid message"):
            dec.decode(enc.encode(msg))


def test_unknown_tag_names_the_tag():
    frame = msgspec.msgpack.encode({"type": "NoSuchMessage", "rid": "x"})
    with pytest.raises(WireError, match="NoSuchMessage"):
        Codec(m.ClientMsg).decode(frame)


def test_missing_tag_is_refused():
    with pytest.raises(WireError, match="type"):
        Codec(m.ClientMsg).decode(msgspec.msgpack.encode({"rid": "x"}))


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"type": "GenerateReq", "text": "hi", "bogus": 1}, "bogus"),
        ({"type": "GenerateReq", "text": "hi", "sampling_params": {"temprature": 0.5}}, "temprature"),
        ({"type": "GenerateReq", "messages": [{"role": "user", "content": "x", "name": "n"}]}, "name"),
        ({"type": "AbortReq", "rid": "x", "why": "because"}, "why"),
        ({"type": "HealthReq", "verbose": True}, "verbose"),
        ({"type": "LoadLoraReq", "lora_name": "a", "lora_path": "/p", "scale": 2}, "scale"),
    ],
)
def test_unknown_client_field_is_refused_by_name(payload, field):
    with pytest.raises(WireError, match=f"unknown field `{field}`"):
        Codec(m.ClientMsg).decode(msgspec.msgpack.encode(payload))


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"type": "AbortReq"}, "rid"),
        ({"type": "GenerateReq", "input_ids": "abc"}, "input_ids"),
        ({"type": "GenerateReq", "text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"type": "GenerateReq", "text": 5}, "text"),
        ({"type": "GenerateReq", "input_ids": [1, 2.5]}, "input_ids"),
    ],
)
def test_missing_or_mistyped_fields_are_refused_by_path(payload, needle):
    with pytest.raises(WireError, match=needle):
        Codec(m.ClientMsg).decode(msgspec.msgpack.encode(payload))


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)
