"""The decode KV mirror (gpu_worker/decode_mirror.py): its row plan, and a worker's logits with it equal to
the plain paged gather through joins, leaves, skipped steps, re-admission, a failed step and the size cap."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch
from loom_helpers import make_args

from gpu_worker.decode_mirror import DecodeKVMirror
from ipc.messages import BatchReq, ForwardBatch, WorkerSampling

GREEDY = WorkerSampling(0.0, 1.0, -1, None)


def test_row_plan_keeps_rows_moves_last_rows_into_holes_and_fills_newcomers():
    m = DecodeKVMirror(num_layers=1, kv_heads=2, head_dim=4, device=torch.device("cpu"))
    u = m.use([("a", 0), ("b", 1), ("c", 2)], [5, 7, 9], torch.float32)
    assert u.order == [0, 1, 2] and u.fill_rows.tolist() == [0, 1, 2] and u.append_rows is None
    m.commit()
    u = m.use([("a", 0), ("b", 1), ("c", 2)], [6, 8, 10], torch.float32)  # a steady step
    assert u.fill_rows is None and u.move_src is None and u.all_append
    # the new token of row 2, head 1 sits at position 9 of a buffer with len_cap positions per (row, head)
    assert u.append_flat.tolist()[-1] == (2 * 2 + 1) * m.len_cap + 9
    m.commit()
    # "b" left: c moves from row 2 into b's row 1, so the group's rows stay 0..G-1
    u = m.use([("c", 2), ("a", 0)], [11, 7], torch.float32)
    assert u.move_src.tolist() == [2] and u.move_dst.tolist() == [1] and u.fill_rows is None
    assert u.order == [1, 0] and u.all_append  # a reads row 0, c row 1
    m.commit()
    # "d" arrives and "a" sat a step out (not one token longer than last time): both filled, c appends
    u = m.use([("d", 3), ("c", 2), ("a", 0)], [4, 12, 7], torch.float32)
    assert u.fill_rows.tolist() == [0, 2] and u.append_rows.tolist() == [1] and u.move_src is None
    assert u.order == [0, 1, 2] and not u.all_append
    # not committed (the step failed): everything is refilled next time
    u = m.use([("a", 0), ("c", 2), ("d", 3)], [8, 13, 5], torch.float32)
    assert u.fill_rows.tolist() == [0, 1, 2] and u.append_rows is None
    m.commit()
    # the same request id in another row (re-admitted) is a different request to the mirror
    u = m.use([("a", 5), ("c", 2), ("d", 3)], [9, 14, 6], torch.float32)
    assert u.fill_rows.tolist() == [0] and u.append_rows.tolist() == [1, 2]
    m.commit()
    # a request being prefilled again (re-admitted after a restart) loses its row even if its length would fit
    m.forget({"c"})
    u = m.use([("a", 5), ("c", 2), ("d", 3)], [10, 15, 7], torch.float32)
    assert u.fill_rows.tolist() == [1] and u.append_rows.tolist() == [0, 2]


def test_size_cap_falls_back_to_none():
    m = DecodeKVMirror(num_layers=30, kv_heads=3, head_dim=64, device=torch.device("cpu"), max_bytes=1 << 20)
    assert m.use([("a", 0)], [10], torch.float32) is None and m.rows_cap == 0


def _plans(seed: int, vocab: int = 30000) -> list[list[BatchReq]]:
    """A churny schedule: requests join (prefill), decode, sometimes sit a step out, finish; one re-admission."""
    rng = random.Random(seed)
    plans: list[list[BatchReq]] = []
    live: dict[str, list] = {}  # rid -> [req_idx, base slot, length so far, steps left]
    nxt, free_rows, base = 0, list(range(16)), 0
    for step in range(14):
        plan = []
        for rid, st in list(live.items()):
            if st[3] == 0:
                free_rows.append(st[0])
                del live[rid]
                continue
            if rng.random() < 0.15:
                continue  # sits this step out
            plan.append(BatchReq(rid, st[0], [rng.randrange(100, vocab)], st[2], [st[1] + st[2]], None, GREEDY, 1))
            st[2] += 1
            st[3] -= 1
        joins = 3 if step == 0 else rng.choice([0, 0, 1])
        if step == 8:  # r0 comes back under another row: recomputed from scratch (a re-admission)
            joins = 0
            n = rng.randrange(20, 60)
            row = free_rows.pop(0)
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            plan.append(BatchReq("r0", row, ids, 0, list(range(base, base + n)), None, GREEDY))
            live["r0"] = [row, base, n, 4]
            base += 200
        for _ in range(joins):
            rid, n = f"r{nxt + 1}", rng.randrange(5, 90)
            nxt += 1
            row = free_rows.pop(0)
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            plan.append(BatchReq(rid, row, ids, 0, list(range(base, base + n)), None, GREEDY))
            live[rid] = [row, base, n, rng.randrange(3, 9)]
            base += 200
        plans.append(plan)
    return plans


@pytest.fixture
def sdpa_only(monkeypatch):
    """Workers built in this test attend with SDPA: with the C decode attention (gpu_worker/decode_attention.py) a
    worker reads the paged cache in place and keeps no mirror."""
    import gpu_worker.decode_attention as da

    monkeypatch.setattr(da, "choose_decode_attention", lambda *a, **k: (None, "SDPA (test)"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_the_paged_gather_through_churn(model_path, dtype, monkeypatch, sdpa_only):
    from gpu_worker.worker import Worker

    w = Worker(make_args(model_path, dtype=dtype, max_total_tokens=4096))
    assert w.decode_mirror is not None
    plans = _plans(0)
    seen = {"fill": 0, "append": 0, "move": 0}
    real_use = w.decode_mirror.use

    def spy(keys, lengths, dt):
        u = real_use(keys, lengths, dt)
        if u is not None:
            seen["fill"] += u.fill_rows is not None
            seen["append"] += u.append_rows is not None
            seen["move"] += u.move_src is not None
        return u

    monkeypatch.setattr(w.decode_mirror, "use", spy)
    real_forward = w.model.forward
    calls = {"n": 0}

    def flaky(*a, **k):  # the 6th step raises half-way (after the mirror was planned): never committed
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected")
        return real_forward(*a, **k)

    monkeypatch.setattr(w.model, "forward", flaky)
    with_mirror = []
    for k, plan in enumerate(plans):
        try:
            with_mirror.append(w.forward_logits(ForwardBatch(k + 1, plan)).clone())
        except RuntimeError:
            with_mirror.append(w.forward_logits(ForwardBatch(k + 1, plan)).clone())  # the retry refills
    assert seen["fill"] and seen["append"] and seen["move"], seen
    w.decode_mirror = None
    for k, plan in enumerate(plans):
        plain = w.forward_logits(ForwardBatch(k + 1, plan))
        assert torch.equal(plain, with_mirror[k]), (k, (plain - with_mirror[k]).abs().max().item())


@pytest.mark.parametrize("path", ["mirror", "gather", "c-kernel"])
def test_a_finished_requests_inf_kv_never_reaches_the_next_rows_padding(model_path, path, monkeypatch):
    """An adapter whose activations overflow leaves inf in its KV. A later request in its row (and mirror row),
    decoding next to a longer one, must not read that inf through its padded positions: 0 x inf is NaN. With
    SDPA over the mirror or a gather, and with the C kernel reading the paged cache in place (when it builds)."""
    import gpu_worker.decode_attention as da
    from gpu_worker.worker import Worker

    if path != "c-kernel":
        monkeypatch.setattr(da, "choose_decode_attention", lambda *a, **k: (None, "SDPA (test)"))
    w = Worker(make_args(model_path, max_total_tokens=4096))
    if path == "gather":
        w.decode_mirror = None
    if path == "c-kernel":
        if w.model.decode_attn is None:
            d = Path(tempfile.mkdtemp())
            fn = da.load_decode_attention(d)
            if fn is None:
                pytest.skip(f"no C decode attention here: {da.LOAD_NOTES[d]}")
            w.model.decode_attn, w.decode_mirror = da.as_callable(fn), None
        assert w.decode_mirror is None
    rng = random.Random(1)
    h_ids, p_ids, n_ids = ([rng.randrange(100, 30000) for _ in range(n)] for n in (60, 80, 10))
    h_slots, p_slots, n_slots = list(range(0, 70)), list(range(100, 190)), list(range(300, 320))

    def run(poison: bool) -> list[torch.Tensor]:
        out = []
        w.forward_logits(
            ForwardBatch(
                1,
                [
                    BatchReq("h", 0, h_ids, 0, h_slots[:60], None, GREEDY),
                    BatchReq("p", 1, p_ids, 0, p_slots[:80], None, GREEDY),
                ],
            )
        )
        if poison:
            for layer in range(len(w.kv.k)):
                w.kv.k[layer][h_slots[:60]] = float("inf")
                w.kv.v[layer][h_slots[:60]] = float("inf")
        w.forward_logits(
            ForwardBatch(
                2,
                [
                    BatchReq("h", 0, [7], 60, [h_slots[60]], None, GREEDY, 1),
                    BatchReq("p", 1, [7], 80, [p_slots[80]], None, GREEDY, 1),
                ],
            )
        )
        out.append(  # h finished; n takes its row 0 while p decodes
            w.forward_logits(
                ForwardBatch(
                    3,
                    [
                        BatchReq("n", 0, n_ids, 0, n_slots[:10], None, GREEDY),
                        BatchReq("p", 1, [8], 81, [p_slots[81]], None, GREEDY, 2),
                    ],
                )
            ).clone()
        )
        out.append(  # n (11 positions) and p (82) decode in one group: n's positions 11..81 are padding
            w.forward_logits(
                ForwardBatch(
                    4,
                    [
                        BatchReq("n", 0, [9], 10, [n_slots[10]], None, GREEDY, 1),
                        BatchReq("p", 1, [9], 82, [p_slots[82]], None, GREEDY, 3),
                    ],
                )
            ).clone()
        )
        return out

    clean = run(poison=False)
    poisoned = run(poison=True)
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)


def test_decode_mirror_mb_sets_the_cap_and_zero_turns_it_off(model_path, sdpa_only):
    from gpu_worker.worker import Worker

    assert Worker(make_args(model_path, decode_mirror_mb=0)).decode_mirror is None
    assert Worker(make_args(model_path, decode_mirror_mb=64)).decode_mirror.max_bytes == 64 << 20
