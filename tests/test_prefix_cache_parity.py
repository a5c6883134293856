"""Prefix cache and chunked prefill on the real SmolLM2 checkpoint: exact against transformers / peft fp32.

An in-process Worker + Scheduler (TP=1) and two gloo ranks (TP=2) run prompts that share none, part or all of
an earlier prompt, prefilled in small chunks; prefill logits stay within 1e-3 of transformers and greedy
tokens are identical. With LoRA, a prompt cached under adapter A is asked for under adapter B, under the base
model and under a new adapter loaded with A's name from another folder (a new uid): none reuses a token of the
others' KV (asserted on the reported cached-token count) and each matches its own peft reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loom_helpers import make_args
from loom_helpers import until_eos as cut

from ipc.messages import ForwardBatch, SamplingParams, TokenizedReq

pytestmark = pytest.mark.slow

ATOL = 1e-3
NEW = 12


def drive(worker, sched, batches: list[list[TokenizedReq]]) -> dict[str, dict]:
    """Run each group of requests to completion in turn (greedy: argmax of the worker's logits, as
    ``sample_rows`` does for temperature 0). Returns per rid: ``ids`` (output), ``cached`` (reported cached
    tokens) and ``logits`` (the logits its first token was taken from)."""
    out: dict[str, dict] = {}
    for group in batches:
        for msg in group:
            assert sched.add(msg) == []
        while sched.has_work:
            fb: ForwardBatch = sched.next_batch()
            rows = list(sched._in_flight)
            logits = worker.forward_logits(fb)
            toks = logits.argmax(-1).tolist()
            for i, (r, kind) in enumerate(rows):
                if kind == "last" and r.rid not in out:
                    out[r.rid] = {"logits": logits[i].clone(), "ids": [], "cached": None}
            for o in sched.on_result(toks):
                assert o.error is None, o.error
                out[o.rid]["ids"] += o.new_ids
                out[o.rid]["cached"] = o.cached_tokens
    return out


def greedy_req(rid: str, ids: list[int], uid: str | None = None, n: int = NEW) -> TokenizedReq:
    return TokenizedReq(rid, list(ids), SamplingParams(max_new_tokens=n, temperature=0.0), lora_uid=uid)


def new_scheduler(cache: bool = True, chunk: int = 24, **kw):
    from scheduler_proc.scheduler import Scheduler

    return Scheduler(
        max_running=16,
        kv_capacity=2048,
        context_len=2048,
        eos_ids=[2],
        enable_prefix_cache=cache,
        chunked_prefill_size=chunk,
        **kw,
    )


@pytest.fixture(scope="module")
def worker(model_path):
    from gpu_worker.worker import Worker

    return Worker(make_args(model_path))


def test_shared_prefixes_match_transformers_and_cache_off(worker, reference, prompts_ids):
    """chat_france, then chat_long_summary (shares the chat template's system turn), then both again (all but
    the last token cached) and raw_fox (nothing shared); everything prefilled in 24-token chunks."""
    names = ["chat_france", "chat_long_summary", "raw_fox"]
    ids = {n: prompts_ids[n] for n in names}
    plan = [
        [greedy_req("france-1", ids["chat_france"])],
        [greedy_req("summary-1", ids["chat_long_summary"])],
        [greedy_req(f"{n}-2", ids[n]) for n in names],
    ]
    sched = new_scheduler()
    on = drive(worker, sched, plan)
    off = drive(worker, new_scheduler(cache=False, chunk=0), plan)
    shared = 0
    while ids["chat_france"][shared] == ids["chat_long_summary"][shared]:
        shared += 1
    assert shared > 20
    want_cached = {
        "france-1": 0,
        "summary-1": shared,
        "chat_france-2": len(ids["chat_france"]) - 1,
        "chat_long_summary-2": len(ids["chat_long_summary"]) - 1,
        "raw_fox-2": 0,
    }
    rid_prompt = {"france-1": "chat_france", "summary-1": "chat_long_summary"} | {f"{n}-2": n for n in names}
    for rid, cached in want_cached.items():
        ref = reference[rid_prompt[rid]]
        assert on[rid]["cached"] == cached, rid
        assert on[rid]["ids"] == cut(ref["greedy"], NEW), rid
        assert on[rid]["ids"] == off[rid]["ids"], rid
        assert (on[rid]["logits"] - ref["logits"]).abs().max().item() < ATOL, rid
        assert (on[rid]["logits"] - off[rid]["logits"]).abs().max().item() < ATOL, rid
    stats = sched.cache_stats()
    assert stats["cached_tokens_total"] == sum(want_cached.values())
    assert stats["prompt_tokens_total"] == sum(len(ids[rid_prompt[rid]]) for rid in want_cached)


def test_adapters_never_share_cached_kv(tmp_path):
    """Cached under adapter A; then B, base, and a new adapter under A's old name from another folder."""
    from lora_helpers import peft_reference, real_adapters, real_model_path, server_args
    from lora_helpers import until_eos as lcut

    from gpu_worker.worker import Worker

    ref = peft_reference()
    ids = ref["input_ids"]["chat_france"]
    folders = real_adapters()
    args = server_args(
        real_model_path(),
        dtype="float32",
        enable_lora=True,
        max_loras_per_batch=4,
        max_lora_rank=64,
        max_total_tokens=1024,
        max_running_requests=8,
    )
    worker = Worker(args)
    worker.lora.load("uid-A1", "r8-all", str(folders["r8-all"]))
    worker.lora.load("uid-B", "r16-attn", str(folders["r16-attn"]))
    sched = new_scheduler(chunk=16, max_loras_per_batch=4)
    sched.loaded_uids = {"uid-A1", "uid-B"}
    n = 16

    def want(tag: str) -> list[int]:
        return lcut(ref["greedy"][f"{tag}|chat_france"], n)

    got = drive(worker, sched, [[greedy_req("A", ids, "uid-A1", n)]])
    assert got["A"]["ids"] == want("r8-all") and got["A"]["cached"] == 0
    got = drive(worker, sched, [[greedy_req("B", ids, "uid-B", n)], [greedy_req("base", ids, None, n)]])
    assert got["B"]["cached"] == 0 and got["B"]["ids"] == want("r16-attn")
    assert got["base"]["cached"] == 0 and got["base"]["ids"] == want("base")
    # unload A (what scheduler_proc.main does on LoraUnloadCmd), load r32-qv's folder under A's old name
    sched.block_adapter("uid-A1")
    worker.lora.unload("uid-A1")
    sched.unblock_adapter("uid-A1")
    worker.lora.load("uid-A2", "r8-all", str(folders["r32-qv"]))
    sched.loaded_uids = {"uid-A2", "uid-B"}
    got = drive(worker, sched, [[greedy_req("A2", ids, "uid-A2", n)]])
    assert got["A2"]["cached"] == 0 and got["A2"]["ids"] == want("r32-qv")
    # the positive control: each adapter does reuse its own cached prompt, with unchanged output
    got = drive(worker, sched, [[greedy_req(f"{t}-again", ids, u, n) for t, u in (("A2", "uid-A2"), ("B", "uid-B"))]])
    assert got["A2-again"]["cached"] == len(ids) - 1 and got["A2-again"]["ids"] == want("r32-qv")
    assert got["B-again"]["cached"] == len(ids) - 1 and got["B-again"]["ids"] == want("r16-attn")
    for tag, logit_ref in (("A2-again", "r32-qv"), ("B-again", "r16-attn")):
        err = (got[tag]["logits"] - ref["logits"][f"{logit_ref}|chat_france"]).abs().max().item()
        assert err < ATOL, (tag, err)
    del worker


# ----------------------------------------------------------------------------- TP=2


def _tp2_rank(rank: int, world: int, init: str, model_path: str, prompts: list, out_file: str) -> None:
    """One rank: every rank plans with its own Scheduler copy (same inputs, same plans); rank 0's tokens are
    broadcast so every copy stays in step, as the scheduler process would send one plan to all ranks."""
    from datetime import timedelta

    import torch.distributed as dist

    from gpu_worker.main import setup_cpu_all_reduce
    from gpu_worker.worker import Worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    reducer = None
    try:
        w = Worker(make_args(Path(model_path), tp_size=world), rank, dist.group.WORLD, torch.device("cpu"))
        reducer = setup_cpu_all_reduce(w, dist.group.WORLD, 1)
        sched = new_scheduler(chunk=16)
        outs: dict[str, dict] = {}
        for group in prompts:
            for rid, ids in group:
                sched.add(greedy_req(rid, ids, n=8))
            while sched.has_work:
                fb = sched.next_batch()
                res = w.step(fb)
                box = [res.next_ids]
                dist.broadcast_object_list(box, src=0)
                for o in sched.on_result(box[0]):
                    d = outs.setdefault(o.rid, {"ids": [], "cached": 0})
                    d["ids"] += o.new_ids
                    d["cached"] = o.cached_tokens
        if rank == 0:
            torch.save(outs, out_file)
    finally:
        if reducer is not None:
            reducer.close()
        dist.destroy_process_group()


def test_tp2_prefix_reuse_is_exact(model_path, reference, prompts_ids, tmp_path):
    import torch.multiprocessing as mp

    from ipc.config import free_tcp_port

    a, b = prompts_ids["chat_france"], prompts_ids["chat_long_summary"]
    prompts = [[("a1", a)], [("b1", b), ("a2", a)]]
    out_file = str(tmp_path / "tp2.pt")
    mp.spawn(
        _tp2_rank,
        args=(2, f"tcp://127.0.0.1:{free_tcp_port()}", str(model_path), prompts, out_file),
        nprocs=2,
        join=True,
    )
    outs = torch.load(out_file, weights_only=False)
    assert outs["a1"]["cached"] == 0 and outs["a2"]["cached"] == len(a) - 1 and outs["b1"]["cached"] > 20
    for rid, name in (("a1", "chat_france"), ("a2", "chat_france"), ("b1", "chat_long_summary")):
        assert outs[rid]["ids"] == cut(reference[name]["greedy"], 8), rid
