"""``LlamaShard.forward_greedy``: TP ranks pick each row's argmax from their own vocabulary columns, exactly as the
argmax over the gathered logits would (first maximal index on ties), and fall back to the gathered logits for a
row whose maximum is not finite.

Each rank here is a shard whose layers and head are stubbed to slices of one ``[B, vocab]`` logits tensor; the
all-reduce adds the other ranks' pairs as their own ``forward_greedy`` would write them. Real TP ranks take this
path in every greedy step of ``tests/test_tp_parity.py`` (tokens against transformers at TP=2 and TP=3).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpu_worker.model import LlamaShard
from gpu_worker.vocab_parallel import vocab_range


def _pair(full: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hi <= lo:
        return torch.full((full.shape[0],), float("-inf"), dtype=torch.float64), torch.zeros(full.shape[0])
    m, i = full[:, lo:hi].max(-1)
    return m.double(), (i + lo).double()


def _shard(rank: int, spans: list[tuple[int, int]], full: torch.Tensor) -> LlamaShard:
    """Rank ``rank`` of ``len(spans)`` whose head yields ``full[:, its span]``."""
    m = object.__new__(LlamaShard)
    m.tp, m.plan, m.vocab = len(spans), SimpleNamespace(rank=rank), full.shape[1]
    m.vocab_lo, m.vocab_hi = spans[rank]
    m.vocab_spans = spans
    m._last_hidden = lambda s, kv, lora: torch.zeros(full.shape[0], 8)  # type: ignore[method-assign]
    m._head = lambda last: full[:, m.vocab_lo : m.vocab_hi].clone()  # type: ignore[method-assign]

    def all_reduce(t: torch.Tensor) -> None:
        for r, (lo, hi) in enumerate(spans):
            if r != rank:
                mx, ix = _pair(full, lo, hi)
                t[:, 2 * r] += mx
                t[:, 2 * r + 1] += ix

    m.all_reduce_fn = all_reduce
    m.gather_logits_fn = lambda part, sp: full.clone() if rank == 0 else part
    return m


def _spans(vocab: int, tp: int) -> list[tuple[int, int]]:
    return [vocab_range(vocab, tp, r) for r in range(tp)]


@pytest.mark.parametrize("tp,vocab", [(2, 300), (3, 300), (3, 128)], ids=["tp2", "tp3", "tp3-empty-span"])
def test_argmax_over_the_ranks_is_the_argmax_of_the_whole_row(tp, vocab):
    """Random rows, plus ties across spans (the lower span must win) and within a span (its first index)."""
    spans = _spans(vocab, tp)
    assert (spans[-1][0] == spans[-1][1]) == (vocab == 128)  # 128 over 3 ranks in 64-row steps: the last has none
    g = torch.Generator().manual_seed(tp * vocab)
    full = torch.randn(6, vocab, generator=g)
    lo1 = spans[1][0]
    full[0, 5] = full[0, lo1 + 3] = 9.0  # tie across ranks 0 and 1: index 5
    full[1, lo1 + 7] = full[1, lo1 + 9] = 8.0  # tie inside rank 1: the first
    full[2, -1] = 7.5  # the last column of the vocabulary
    full[3] = 0.0  # every value equal: index 0
    full[4, :] = float("-inf")
    full[4, lo1 + 1] = -3.0  # one finite value among -inf
    want = full.max(-1).indices.tolist()
    for rank in range(tp):
        tokens, logits = _shard(rank, spans, full).forward_greedy(None, None)  # type: ignore[arg-type]
        assert logits is None and tokens == want, rank


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_a_row_without_a_finite_max_falls_back_to_the_gathered_logits(bad):
    """Every rank sees the same pairs, so all take the gather; rank 0 gets the whole logits for the sampler's
    error message, the others their own columns."""
    spans = _spans(300, 2)
    full = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    col = spans[1][0] + 2  # in rank 1's columns: rank 0 learns of it only through the all-reduce
    if bad == "nan":
        full[1, col] = float("nan")
    elif bad == "+inf":
        full[1, col] = float("inf")
    else:
        full[1, :] = float("-inf")
    for rank in range(2):
        tokens, logits = _shard(rank, spans, full).forward_greedy(None, None)  # type: ignore[arg-type]
        assert tokens is None
        want = full if rank == 0 else full[:, spans[1][0] : spans[1][1]]
        assert torch.equal(logits.nan_to_num(), want.nan_to_num()), rank


def test_tp1_is_refused_before_running_the_layers():
    m = _shard(0, [(0, 10)], torch.zeros(1, 10))
    m._last_hidden = None  # type: ignore[assignment]  # must not be reached
    with pytest.raises(ValueError, match="TP > 1"):
        m.forward_greedy(None, None)  # type: ignore[arg-type]


def _greedy_rank_main(rank: int, world: int, init: str, model_path: str, prompts: list, out: str, shm: bool) -> None:
    """One real TP rank (a ``torch.multiprocessing.spawn`` target): a greedy prefill step through
    ``Worker.step`` (the argmax over the ranks), then the same step's gathered logits, then the step again with
    row 1's logits NaN in rank 1's columns (which only rank 1 sees)."""
    from datetime import timedelta

    import torch.distributed as dist
    from loom_helpers import make_args, prefill_batch

    from gpu_worker.main import setup_cpu_all_reduce
    from gpu_worker.worker import Worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    reducer = None
    try:
        w = Worker(make_args(Path(model_path), tp_size=world), rank, dist.group.WORLD, torch.device("cpu"))
        if shm:
            reducer = setup_cpu_all_reduce(w, dist.group.WORLD, 1)
            assert reducer is not None, "the shared-memory all-reduce was expected on this host"
        fb = prefill_batch(prompts)
        gathers = []
        gather = w.model._gather_logits
        w.model._gather_logits = lambda *a: gathers.append(1) or gather(*a)
        fast = w.step(fb)
        fast_gathers = len(gathers)
        logits = w.forward_logits(fb)  # the same prefill again: the same K/V rewritten, the logits gathered
        head = w.model._head
        if rank == 1:

            def poisoned(last: torch.Tensor) -> torch.Tensor:
                part = head(last)
                part[1, 3] = float("nan")
                return part

            w.model._head = poisoned
        slow = w.step(fb)
        if rank == 0:
            torch.save(
                {"fast": fast, "gathers": (fast_gathers, len(gathers)), "argmax": logits.argmax(-1).tolist(),
                 "poisoned": slow},
                out,
            )  # fmt: skip
        # Drop the group's last users before tearing it down: the patched ``_gather_logits`` and ``_head`` close
        # over the model's own bound methods, a cycle that ``del w`` alone leaves alive, and the model's all-reduce
        # holds the group. A gloo group the collector frees during interpreter exit can abort the rank
        # (``terminate called without an active exception``, seen once in CI).
        vars(w.model).pop("_gather_logits")
        vars(w.model).pop("_head", None)
        model = weakref.ref(w.model)
        del w
        gather = head = None  # bound methods: they hold the model too
        gc.collect()
        assert model() is None, "the model outlived the worker: the gloo group would be freed at exit"
        dist.barrier()
    finally:
        if reducer is not None:
            reducer.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_real_ranks_take_the_argmax_path_and_fall_back(shm, model_path, prompts_ids, tmp_path):
    """TP=2 gloo ranks on the real model: ``Worker.step``'s greedy tokens are the argmax of the gathered logits,
    and a NaN that only rank 1's columns hold fails that row alone, with the sampler's message."""
    import torch.multiprocessing as mp

    from ipc.config import free_tcp_port

    prompts = list(prompts_ids.values())[:3]
    out = str(tmp_path / "greedy.pt")
    mp.spawn(
        _greedy_rank_main,
        args=(2, f"tcp://127.0.0.1:{free_tcp_port()}", str(model_path), prompts, out, shm),
        nprocs=2,
        join=True,
    )
    got = torch.load(out, weights_only=False)
    assert got["fast"].next_ids == got["argmax"] and not got["fast"].row_errors
    assert got["gathers"] == (0, 2)  # the greedy step gathered no logits; forward_logits and the fallback did
    bad = got["poisoned"]
    assert set(bad.row_errors) == {1} and "not finite (1 NaN" in bad.row_errors[1]
    assert [t for i, t in enumerate(bad.next_ids) if i != 1] == [t for i, t in enumerate(got["argmax"]) if i != 1]
