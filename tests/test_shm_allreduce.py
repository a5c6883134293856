"""The same-host shared-memory TP all-reduce (gpu_worker.shm_allreduce) across real gloo processes.

2 and 3 spawned ranks: sums equal to the exact sum / the rank-order fp32 sum (fp32 and bf16, small, odd, empty,
chunked and large shapes), bit-identical on every rank, a long run of back-to-back ops (double-buffer races),
both segment kinds, nothing left in /dev/shm, ranks out of step stopped, the same shm/gloo choice on every rank
when one rank is on another host or CPU; a peer that dies or hangs makes the survivor raise in time with an
error ``gpu_worker.main`` recognises as a lost peer. Plus the start-up thread-count probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import statistics
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch

SHM = Path("/dev/shm")


def _loom_shm() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("loom")}


def _digest(t: torch.Tensor) -> int:
    """A 63-bit hash of the tensor's bytes (bit-identity check across ranks)."""
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") >> 1


def _inputs(case: int, world: int, shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> list[torch.Tensor]:
    """Every rank's input for one case (each rank builds all of them, so each can compute the expected sum).

    ``randn``: random normals; ``int``: random integers in [-40, 40], whose sum over 3 ranks is exact in bf16.
    """
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * case + r)
        if kind == "int":
            t = torch.randint(-40, 41, shape, generator=g, dtype=torch.int8).to(dtype)
        else:
            t = torch.randn(shape, generator=g).to(dtype)
        out.append(t)
    return out


def _check_sums(rank: int, world: int) -> None:
    import torch.distributed as dist

    from gpu_worker.shm_allreduce import ShmAllReduce, ShmAllReduceError, ShmUnavailable, select_all_reduce

    def same_on_all_ranks(t: torch.Tensor, what: str) -> None:
        mine = torch.tensor([_digest(t)], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine)
        assert len({int(g) for g in got}) == 1, f"{what}: ranks differ"

    none, why = select_all_reduce(None, mode="gloo")
    assert none is None and "gloo" in why
    shm, why = select_all_reduce(None, timeout_s=10.0, mode="auto")
    assert shm is not None and shm.method == "memfd", why
    tiny = ShmAllReduce(slot_bytes=4096, timeout_s=10.0, method="named", epoch=7)  # many chunks; the named kind
    dist.barrier()  # rank 0 unlinks right after the attach collective
    assert not [n for n in os.listdir(SHM) if n.startswith("loom-ar-")], "the name must be unlinked at once"
    cases = [
        ((1, 576), torch.bfloat16, "randn"),
        ((1, 576), torch.float32, "randn"),
        ((32, 576), torch.bfloat16, "randn"),
        ((32, 576), torch.float32, "randn"),
        ((7, 3), torch.float32, "int"),
        ((0, 576), torch.float32, "randn"),
        ((33, 100), torch.bfloat16, "int"),
        ((300, 576), torch.float32, "randn"),  # 3+ ranks: reduce-scatter from 256 KiB
        ((131075,), torch.bfloat16, "randn"),  # reduce-scatter, uneven shares
        ((16384, 576), torch.bfloat16, "int"),  # 18 MiB: 5 ops through the 4 MiB slots
        ((16384, 576), torch.float32, "int"),  # 36 MiB: 9 ops
    ]
    for case, (shape, dtype, kind) in enumerate(cases):
        xs = _inputs(case, world, shape, dtype, kind)
        big = xs[0].numel() > 100_000
        acc = xs[0].float()
        for x in xs[1:]:
            acc = acc + x.float()  # rank order, fp32: the documented result
        want = acc.to(dtype)
        for red, name in ((shm, "memfd"), (tiny, "named/4 KiB slots")):
            if name != "memfd" and big:
                continue
            got = xs[rank].clone()
            red.all_reduce(got)
            what = f"{name} {list(shape)} {dtype}"
            assert torch.equal(got, want), what
            if kind == "randn":
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert torch.allclose(got.double(), sum(x.double() for x in xs), rtol=tol, atol=tol), what
            # (small integers: ``want`` is the exact sum, in any order)
            same_on_all_ranks(got, what)
        if dtype == torch.float32 and kind == "randn":  # and gloo agrees
            ref = xs[rank].clone()
            dist.all_reduce(ref)
            assert torch.allclose(want, ref, rtol=1e-6, atol=1e-6)
    # the vocab-parallel head's gather: rank 0 gets every rank's columns, the others keep their own
    for rows, width, dtype in ((1, 49152, torch.bfloat16), (32, 49152, torch.float32), (5, 7, torch.float32)):
        spans = [(min(width, r * -(-width // world)), min(width, (r + 1) * -(-width // world))) for r in range(world)]
        whole = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(dtype)
        for red, name in ((shm, "memfd"), (tiny, "named/4 KiB slots")):
            part = whole[:, spans[rank][0] : spans[rank][1]].contiguous()
            got = red.gather_columns(part, spans)
            want = whole if rank == 0 else part
            assert torch.equal(got, want), f"gather {name} {rows}x{width} {dtype}"
    t = torch.ones(3)
    shm.all_reduce(t)  # all-reduces and gathers interleave
    assert t.tolist() == [float(world)] * 3
    with torch.inference_mode():  # the model calls it under inference mode
        t = torch.ones(4, 576)
        shm.all_reduce(t)
        assert torch.equal(t, torch.full((4, 576), float(world)))
    # back-to-back ops, values changing every op: a double-buffer slip would show up as a wrong sum
    for red in (shm, tiny):
        for it in range(500):
            t = torch.full((5 + it % 3,), float(rank + it), dtype=torch.float32)
            red.all_reduce(t)
            assert t[0].item() == world * it + world * (world - 1) / 2, (it, t[0].item())
    shm.close()
    tiny.close()
    with pytest.raises(RuntimeError, match="closed"):
        shm.all_reduce(torch.ones(3))
    # ranks that disagree on the op (a rank skipped one) are stopped, not summed
    skew = ShmAllReduce(timeout_s=10.0)
    with pytest.raises(ShmAllReduceError, match="out of step"):
        skew.all_reduce(torch.ones(4 if rank == 1 else 3))
    skew.close()
    skew = ShmAllReduce(timeout_s=10.0)  # one rank gathers while the others all-reduce
    with pytest.raises(ShmAllReduceError, match="out of step"):
        if rank == 0:
            skew.gather_columns(torch.ones(2, 1), [(r, r + 1) for r in range(world)])
        else:
            skew.all_reduce(torch.ones(2 * world))
    skew.close()
    # a rank refused /proc/PID/fd (a hardened container): every rank falls back to the named segment
    real_open = os.open

    def no_proc(path, *args, **kw):
        if str(path).startswith("/proc/"):
            raise PermissionError(13, "Permission denied (test)", str(path))
        return real_open(path, *args, **kw)

    with mock.patch("os.open", side_effect=no_proc) if rank == world - 1 else contextlib.nullcontext():
        fallback = ShmAllReduce(timeout_s=10.0)
    assert fallback.method == "named"
    t = torch.full((3,), float(rank))
    fallback.all_reduce(t)
    assert t.tolist() == [world * (world - 1) / 2] * 3
    fallback.close()
    # the choice is the same on every rank, whatever one rank sees
    with mock.patch("platform.machine", return_value="aarch64" if rank == world - 1 else "x86_64"):
        none, why = select_all_reduce(None, mode="auto")
        assert none is None and "x86-64" in why, why
        with pytest.raises(ShmUnavailable, match="LOOM_TP_ALLREDUCE=shm"):
            select_all_reduce(None, mode="shm")
    with mock.patch("socket.gethostname", return_value=f"host{rank}"):
        none, why = select_all_reduce(None, mode="auto")
        assert none is None and "different hosts" in why, why
    assert not [n for n in os.listdir(SHM) if n.startswith("loom-ar-")]


def _check_faults(rank: int, world: int, out: Path) -> None:
    """Rank 1 stops itself: rank 0 times out on reducer A; rank 0 then kills rank 1: reducer B sees it gone."""
    import torch.distributed as dist

    from gpu_worker.shm_allreduce import ShmAllReduce, ShmAllReduceError

    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    hang = ShmAllReduce(timeout_s=1.0)
    dead = ShmAllReduce(timeout_s=20.0)
    for red in (hang, dead):
        red.all_reduce(torch.ones(8, 576))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 kills us
    lines = []
    for red in (hang, dead):
        t0 = time.monotonic()
        try:
            red.all_reduce(torch.ones(8, 576))
            msg = "no error"
        except ShmAllReduceError as e:
            msg = str(e)
        lines += [f"{time.monotonic() - t0}", msg]
        if red is hang:
            os.kill(int(pids[1]), signal.SIGKILL)
    try:
        dead.all_reduce(torch.ones(2))
        lines.append("no error")
    except ShmAllReduceError as e:
        lines.append(str(e))
    out.write_text("\n".join(lines) + "\n")
    os._exit(0)  # the gloo group lost a member: skip its teardown


def _rank_main(rank: int, world: int, init: str, scenario: str, out_dir: str) -> None:
    """One spawned rank: join a gloo group, run ``scenario``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if scenario == "sums":
        _check_sums(rank, world)
        dist.destroy_process_group()
    else:
        _check_faults(rank, world, Path(out_dir) / f"rank{rank}.txt")


def _spawn(world: int, scenario: str, out_dir: Path, timeout_s: float = 60.0) -> list[int]:
    """Run ``world`` ranks of ``scenario``; returns their exit codes (a stopped rank is killed at the end)."""
    import torch.multiprocessing as mp

    from ipc.config import free_tcp_port

    # forkserver: torch is imported once in the server, not once per rank (about 2 s of CPU each here)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "gpu_worker.shm_allreduce"])
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, scenario, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(procs):
            p.join(max(0.1, deadline - time.monotonic()))
            assert p.exitcode is not None, f"rank {r} of {scenario} did not finish in {timeout_s} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [2, 3])
def test_sums_exact_identical_and_leave_nothing(world, tmp_path):
    before = _loom_shm()
    codes = _spawn(world, "sums", tmp_path)
    assert codes == [0] * world, codes
    assert not (_loom_shm() - before), "a /dev/shm entry was left behind"


def test_hung_or_dead_peer_raises_in_time(tmp_path):
    from gpu_worker.main import _peer_gone

    before = _loom_shm()
    codes = _spawn(2, "faults", tmp_path)
    assert codes == [0, -signal.SIGKILL], codes
    hang_s, hang_msg, dead_s, dead_msg, again = (tmp_path / "rank0.txt").read_text().splitlines()
    assert "rank 1 did not arrive within 1 s" in hang_msg, hang_msg
    assert 1.0 <= float(hang_s) < 3.0, hang_s
    assert "peer rank 1" in dead_msg and "is gone" in dead_msg, dead_msg
    assert float(dead_s) < 2.0, dead_s  # far below its 20 s timeout: the pid watch noticed
    assert again == dead_msg  # the op sequence is broken for good: later calls fail at once
    assert _peer_gone(RuntimeError(hang_msg)) and _peer_gone(RuntimeError(dead_msg))
    assert not (_loom_shm() - before)


def test_thread_probe_is_cheap_and_respects_override(monkeypatch):
    from gpu_worker.threads import measure_threads, pick_num_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert pick_num_threads(1)[1] == "OMP_NUM_THREADS=1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert pick_num_threads(1 << 20)[0] == 1  # tp over the CPU count: one thread each, nothing measured
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    n, scores = measure_threads(2, windows=1)  # one window: an ambiguous one is measured again 0.5 s later
    assert time.perf_counter() - t0 < 1.0
    assert n in scores and set(scores) == {1, 2}
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "windows, calls, pick",
    [
        ([{1: 100.0, 2: 60.0}], 1, 2),  # decisive: two threads clearly faster
        ([{1: 100.0, 2: 140.0}], 1, 1),  # decisive: one thread fastest
        ([{1: 100.0, 2: 95.0}, {1: 110.0, 2: 60.0}], 2, 2),  # a burst cost the first window: medians 105 / 77.5
        ([{1: 100.0, 2: 95.0}] * 3, 3, 1),  # ambiguous in every window: fewer threads, after three windows
        ([{1: 100.0, 2: 2200.0}, {1: 100.0, 2: 60.0}, {1: 100.0, 2: 60.0}], 3, 2),  # a neighbour's burst, once
        ([{1: 100.0, 2: 2200.0}, {1: 100.0, 2: 60.0}, {1: 100.0, 2: 2500.0}], 3, 1),  # collapsed in most: busy
    ],
)
def test_an_ambiguous_thread_probe_window_is_measured_again(monkeypatch, windows, calls, pick):
    from gpu_worker import threads

    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    seen = iter(windows)
    monkeypatch.setattr(threads, "_window", lambda cands, probes, budget_s: dict(next(seen)))
    n, scores = threads.measure_threads(2)
    assert n == pick and len(windows) - sum(1 for _ in seen) == calls
    assert scores == {k: statistics.median(w[k] for w in windows[:calls]) for k in (1, 2)}


@pytest.mark.parametrize(
    "window, after",
    [
        ({1: 100.0, 2: 60.0}, 2),  # a start-up burst had hidden the second thread: the idle window finds it
        ({1: 100.0, 2: 95.0}, 1),  # ambiguous: kept
        ({1: 100.0, 2: 2200.0}, 1),  # the cores are busy now: kept
    ],
)
def test_a_rank_below_its_thread_cap_measures_again_when_idle(monkeypatch, window, after):
    from gpu_worker import threads

    clock = [1000.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "_window", lambda cands, probes, budget_s: dict(window))
    applied: list[int] = []
    monkeypatch.setattr(threads.torch, "set_num_threads", applied.append)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 1)  # measure_threads restores this count
    r = threads.ThreadRecheck(1, 2, idle_s=1.0, first_s=3.0, gap_s=10.0, checks=2)
    assert not r.due()  # not idle long enough, and just measured at start-up
    clock[0] += 2.5
    assert not r.due()  # idle, but too soon after start-up
    clock[0] += 1.0
    r.worked()  # a step just ran
    assert not r.due()
    clock[0] += 1.0
    assert r.due()
    line = r.run()
    assert r.threads == after and applied == ([1, 2] if after == 2 else [1])
    assert (line is not None) == (after != 1)
    if line:
        assert line.startswith("1 -> 2 intra-op thread(s), measured again while idle")
    clock[0] += 10.0
    assert r.due() == (after == 1)  # at the cap nothing is left to find; else one more check later
    if after == 1:
        r.run()
        clock[0] += 10.0
        assert not r.due()  # checks used up


def test_a_rank_at_its_thread_cap_never_measures_again():
    from gpu_worker.threads import ThreadRecheck

    r = ThreadRecheck(2, 2, idle_s=0.0, gap_s=0.0)
    assert not r.due()
