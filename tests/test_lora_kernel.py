"""The cpu-sgmv C kernel (gpu_worker/csrc/lora_sgmv.c) against float64 maths, and how the backend is chosen."""

from __future__ import annotations

import os
import random

import pytest
import torch

from gpu_worker.lora_kernel import (
    TILE_PAD,
    SgmvLayerArgs,
    SgmvStep,
    b_row_elems,
    choose_backend,
    load_sgmv,
    load_sgmv_gemm,
    pack_b,
    sgmv_add,
    unpack_b,
)
from ipc.lora_config import lora_rows


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """The cache folder the module's real kernel build went into."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def fn(kernel_dir):
    f = load_sgmv(kernel_dir)
    if f is None:
        pytest.skip("no C compiler on this machine: the torch path serves LoRA (tested in test_lora_pool.py)")
    return f


def _case(
    seed: int, in_dim: int, outs: list[int], n_slots: int, max_rank: int, wdt: torch.dtype, empty: tuple[int, ...] = ()
):
    """Slots in the pool's arenas (A rank-major per sub-module, B packed at each slot's rank), each taking
    ``lora_rows`` of its largest rank, placed back to back in a shuffled order (so a slot's AMX tiles read its
    neighbour's rows), plus the plain per-slot matrices for the reference. Slots in ``empty`` have rank 0 in every
    sub-module (an adapter that does not target this projection)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    nmod = len(outs)
    ranks = torch.zeros(n_slots, nmod, dtype=torch.int32)
    for s in range(n_slots):
        for k in range(nmod):
            ranks[s, k] = (
                rnd.choice([0, 1, 3, 8, 16, 33, max_rank]) if max_rank > 16 else rnd.choice([0, 1, 3, 8, max_rank])
            )
    ranks[list(empty)] = 0
    size = [lora_rows(int(ranks[s].max())) for s in range(n_slots)]
    order = list(range(n_slots))
    rnd.shuffle(order)
    start = torch.zeros(n_slots, dtype=torch.int64)
    pos = 0
    for s in order:
        start[s], pos = pos, pos + size[s]
    a = torch.zeros(pos * nmod + 16, in_dim, dtype=wdt)  # 16 rows after the arena, as the pool
    bs = [torch.zeros(pos * b_row_elems(o) + TILE_PAD, dtype=wdt) for o in outs]
    plain = {}
    for s in range(n_slots):
        st = int(start[s])
        for k, o in enumerate(outs):
            r = int(ranks[s, k])
            am = (torch.randn(r, in_dim, generator=g) * 0.1).to(wdt)
            bm = (torch.randn(r, o, generator=g) * 0.1).to(wdt)
            a[st * nmod : (st + size[s]) * nmod].view(size[s], nmod, in_dim)[:r, k] = am
            region = bs[k][st * b_row_elems(o) : (st + size[s]) * b_row_elems(o)]
            pack_b(bm.T, region)
            assert torch.equal(unpack_b(region, o, r), bm)
            plain[s, k] = (am.double(), bm.double())
    cols = [sum(outs[:k]) for k in range(nmod)]
    return SgmvLayerArgs.over_arena(a, bs, outs, ranks, cols, start), plain, cols


@pytest.mark.parametrize(
    "in_dim,outs,xdt,wdt,max_rank",
    [
        (64, [64, 32, 32], torch.float32, torch.float32, 16),
        (96, [96], torch.bfloat16, torch.bfloat16, 16),  # AMX where the CPU has it (32-aligned inputs)
        (128, [80, 48, 16], torch.bfloat16, torch.bfloat16, 45),  # AMX over several 32-rank chunks, odd ranks
        (40, [70, 33], torch.bfloat16, torch.bfloat16, 16),  # widths off the 16/32 grid: tails of both phases
        (72, [50, 18, 18], torch.float32, torch.float32, 16),
        (48, [64, 64], torch.bfloat16, torch.float32, 16),  # a bf16 model over fp32 slots
    ],
)
def test_kernel_matches_float64_maths(fn, in_dim, outs, xdt, wdt, max_rank):
    """Interleaved tokens of several slots (1 to 19 tokens each: every register-block size and partial blocks),
    mixed ranks including rank 0 per sub-module, base tokens untouched."""
    _check_against_float64(fn, in_dim, outs, xdt, wdt, max_rank)


@pytest.fixture(scope="module")
def fn_avx2(tmp_path_factory):
    """The kernel built for AVX2 and FMA only (``LOOM_MARCH=x86-64-v3``: its 8-lane shrink and expand), where this
    compiler targets it and this CPU runs it."""
    before = os.environ.get("LOOM_MARCH")
    os.environ["LOOM_MARCH"] = "x86-64-v3"
    try:
        f = load_sgmv.__wrapped__(tmp_path_factory.mktemp("kernels-avx2"))
    finally:
        if before is None:
            del os.environ["LOOM_MARCH"]
        else:
            os.environ["LOOM_MARCH"] = before
    if f is None:
        pytest.skip("no x86-64-v3 build here (another architecture, compiler or CPU)")
    return f


@pytest.mark.parametrize(
    "in_dim,outs,xdt,wdt,max_rank",
    [
        (64, [64, 32, 32], torch.float32, torch.float32, 16),
        (128, [80, 48, 16], torch.bfloat16, torch.bfloat16, 45),
        (40, [70, 33], torch.bfloat16, torch.bfloat16, 16),
        (72, [50, 18, 18], torch.float32, torch.float32, 16),
        (48, [64, 64], torch.bfloat16, torch.float32, 16),
    ],
)
def test_avx2_build_matches_float64_maths(fn_avx2, in_dim, outs, xdt, wdt, max_rank):
    """The same checks on the AVX2 build (its 8-lane dot_avx2 and axpy_avx2), which CPUs without AVX-512 run."""
    _check_against_float64(fn_avx2, in_dim, outs, xdt, wdt, max_rank)


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_many_segments_match_float64_and_any_thread_count(fn, wdt):
    """A decode step's shape: 40 adapters of 1-3 tokens each, some with no weights in this projection. Each
    thread walks its own run of work items (segments cut anywhere by the split: by item count in the shrink, by
    weight in the expand), so the result must match float64 maths and be the same bits on 1, 2 and 3 threads."""
    in_dim, outs = 64, [64, 32, 32]
    args = (fn, in_dim, outs, torch.bfloat16, wdt, 16)
    threads = torch.get_num_threads()
    try:
        outs_by_threads = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = _check_against_float64(*args, n_slots=40, per_token=[1, 1, 1, 2, 3], seed=5, empty=(0, 17, 39))
            outs_by_threads.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs_by_threads[0], o) for o in outs_by_threads[1:])


def _check_against_float64(
    fn, in_dim, outs, xdt, wdt, max_rank, n_slots=4, per_token=(1, 2, 3, 5, 8, 9, 19), seed=0, empty=()
):
    """One kernel call over ``n_slots`` slots (``per_token``: the choices of each slot's token count; ``empty``:
    slots with no weights) and 5 base-model tokens, against float64 maths; returns the kernel's output."""
    la, plain, cols = _case(in_dim + len(outs) + seed, in_dim, outs, n_slots, max_rank, wdt, empty)
    rnd = random.Random(in_dim + seed)
    per_slot = {s: rnd.choice(per_token) for s in range(n_slots)}
    owner = [s for s, n in per_slot.items() for _ in range(n)] + [-1] * 5  # -1: a base-model token
    rnd.shuffle(owner)
    T = len(owner)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, in_dim, generator=g).to(xdt)
    out0 = torch.randn(T, sum(outs), generator=g).to(xdt)
    tok, seg = [], []
    for s in range(n_slots):
        rows = [t for t in range(T) if owner[t] == s]
        seg.append((s, len(tok), len(tok) + len(rows)))
        tok.extend(rows)
    u = torch.zeros(len(tok) + 8, max_rank * len(outs))
    out = out0.clone()
    sgmv_add(fn, la, x, out, torch.tensor(tok), torch.tensor(seg), u)
    want = out0.double()
    for t in range(T):
        s = owner[t]
        if s < 0:
            continue
        for k, c in enumerate(cols):
            am, bm = plain[s, k]
            want[t, c : c + outs[k]] += (x[t].double() @ am.T) @ bm
    base = [t for t in range(T) if owner[t] < 0]
    assert torch.equal(out[base], out0[base])
    tol = 1e-5 if xdt == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    return out


@pytest.fixture(scope="module")
def gemm_fns(fn, kernel_dir):
    """(loom_lora_sgmv_gemm, loom_bf16_gemm) where this CPU runs Loom's bf16 GEMM (AVX512-BF16)."""
    from gpu_worker.bf16_gemm import Bf16GemmLinear, load_gemm

    fused, gemm = load_sgmv_gemm(kernel_dir), load_gemm(kernel_dir)
    if fused is None or gemm is None:
        pytest.skip("the bf16 GEMM or the fused entry did not build here")
    try:
        Bf16GemmLinear(torch.zeros(48, 64, dtype=torch.bfloat16), gemm).mm(torch.zeros(1, 64, dtype=torch.bfloat16))
    except RuntimeError:
        pytest.skip("no AVX512-BF16 here: bf16 workers multiply on oneDNN and never take the fused call")
    return fused, gemm


def _step_rows(n_slots: int, per_token, seed: int, base_rows: int = 5):
    """Rows of a step: each slot's tokens (a count drawn from ``per_token``) and base rows, shuffled; the kernel's
    token list grouped by slot and its segments."""
    rnd = random.Random(seed)
    owner = [s for s in range(n_slots) for _ in range(rnd.choice(per_token))] + [-1] * base_rows
    rnd.shuffle(owner)
    tok, seg = [], []
    for s in range(n_slots):
        rows = [t for t, o in enumerate(owner) if o == s]
        seg.append((s, len(tok), len(tok) + len(rows)))
        tok.extend(rows)
    return len(owner), torch.tensor(tok, dtype=torch.int64), torch.tensor(seg, dtype=torch.int64).view(-1, 3)


@pytest.mark.parametrize(
    "in_dim,outs,n_slots,max_rank,per_token,empty",
    [
        (64, [64, 32, 32], 4, 16, (1, 2, 3, 5, 8, 9, 19), ()),
        (128, [80, 48, 16], 5, 45, (1, 4, 7, 13), (1,)),  # widths off the GEMM's 48-column panels, odd ranks
        (96, [96, 200], 40, 16, (1, 1, 2, 3), (0, 17)),  # a decode step's many short segments
        (576, [576, 192, 192], 9, 64, (7, 8), ()),  # the model's q|k|v at a 64-row decode step's shape
        (64, [64], 3, 8, (1, 2), (0, 1, 2)),  # no slot has weights here: the GEMM alone
    ],
)
def test_gemm_and_lora_in_one_call_is_the_two_calls_bit_for_bit(fn, gemm_fns, in_dim, outs, n_slots, max_rank,
                                                                 per_token, empty):  # fmt: skip
    """``SgmvStep.mm_add`` (the base GEMM's panels between the shrink's items, then the expand) gives exactly the
    bits of Loom's bf16 GEMM followed by the LoRA kernel's add, on 1, 2 and 3 threads."""
    from gpu_worker.bf16_gemm import Bf16GemmLinear

    fused_fn, gemm = gemm_fns
    la, _, _ = _case(in_dim + n_slots, in_dim, outs, n_slots, max_rank, torch.bfloat16, empty)
    rows, tok, seg = _step_rows(n_slots, per_token, seed=in_dim)
    g = torch.Generator().manual_seed(3)
    w = Bf16GemmLinear((torch.randn(sum(outs), in_dim, generator=g) * 0.05).to(torch.bfloat16), gemm)
    x = torch.randn(rows, in_dim, generator=g).to(torch.bfloat16)
    step = SgmvStep(fn, tok, seg, torch.zeros(len(tok) + 8, max_rank * len(outs)), fused_fn)
    want = w.mm(x)
    step.add(la, x, want)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = step.mm_add(la, x, w)
            assert got is not None and got.shape == want.shape
            assert torch.equal(got, want), f"{n} threads: {(got.float() - want.float()).abs().max()}"
    finally:
        torch.set_num_threads(threads)


def test_one_call_declines_what_it_cannot_take(fn, gemm_fns):
    """Another weight type or an fp32 x: mm_add returns None (the model then multiplies and adds as before);
    without the fused entry, too."""
    from gpu_worker.bf16_gemm import Bf16GemmLinear

    fused_fn, gemm = gemm_fns
    la, _, _ = _case(1, 64, [64], 2, 8, torch.bfloat16)
    rows, tok, seg = _step_rows(2, (2,), seed=1)
    wt = torch.randn(64, 64).to(torch.bfloat16)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    step = SgmvStep(fn, tok, seg, torch.zeros(len(tok) + 8, 8), fused_fn)
    assert step.mm_add(la, x, wt) is None  # a plain tensor weight
    assert step.mm_add(la, x.float(), Bf16GemmLinear(wt, gemm)) is None
    assert SgmvStep(fn, tok, seg, torch.zeros(len(tok) + 8, 8)).mm_add(la, x, Bf16GemmLinear(wt, gemm)) is None


def test_kernel_rejects_what_it_cannot_take(fn):
    la, _, _ = _case(0, 64, [64], 2, 8, torch.float32)
    seg, tok, u = torch.tensor([[0, 0, 1]]), torch.tensor([0]), torch.zeros(9, 8)
    with pytest.raises(ValueError, match="x"):
        sgmv_add(fn, la, torch.zeros(1, 32), torch.zeros(1, 64), tok, seg, u)  # wrong width
    with pytest.raises(ValueError, match="x"):
        sgmv_add(fn, la, torch.zeros(1, 64, dtype=torch.float16), torch.zeros(1, 64), tok, seg, u)
    with pytest.raises(ValueError, match="out"):
        sgmv_add(fn, la, torch.zeros(2, 64), torch.zeros(64, 2).T, tok, seg, u)  # columns not contiguous


def test_no_compiler_means_torch_path(tmp_path, monkeypatch):
    """Without a usable C compiler, auto falls back to torch and an explicit cpu-sgmv says what is missing."""
    monkeypatch.setenv("CC", "/bin/false")
    load_sgmv.cache_clear()
    try:
        fn, how = choose_backend("auto", torch.float32, torch.device("cpu"), tmp_path)
        assert fn is None and "torch" in how
        with pytest.raises(RuntimeError, match="C compiler"):
            choose_backend("cpu-sgmv", torch.float32, torch.device("cpu"), tmp_path)
    finally:
        load_sgmv.cache_clear()


def test_backend_choice(fn, kernel_dir, tmp_path):
    """auto measures once and keeps the answer; torch is always honoured; the kernel's limits hold."""
    import shutil

    shutil.copytree(kernel_dir, tmp_path / "kernels")  # the module's build, found intact: no second compile
    cpu = torch.device("cpu")
    assert choose_backend("torch", torch.float32, cpu, tmp_path) == (None, "--lora-backend torch")
    first = choose_backend("auto", torch.bfloat16, cpu, tmp_path)
    assert "measured earlier" not in first[1]
    again = choose_backend("auto", torch.bfloat16, cpu, tmp_path)
    assert "measured earlier" in again[1] and (again[0] is None) == (first[0] is None)
    assert choose_backend("auto", torch.float32, cpu, tmp_path, widest_in=8192)[0] is None
    with pytest.raises(RuntimeError, match="inputs <= 4096"):
        choose_backend("cpu-sgmv", torch.float32, cpu, tmp_path, widest_in=8192)
    with pytest.raises(RuntimeError, match="fp32/bf16"):
        choose_backend("cpu-sgmv", torch.float16, cpu, tmp_path)


def test_loading_the_kernel_keeps_subnormals(fn):
    """The kernel is built without -ffast-math, whose crtfastmath.o would set flush-to-zero for the whole process
    (torch, the sampler) when the library loads."""
    assert (torch.tensor([1e-39]) * 0.5).item() != 0.0


def test_damaged_cached_kernel_is_rebuilt(tmp_path, fn, kernel_dir):
    """A cached kernel that is not the file the build wrote (truncated, overwritten) is rebuilt with OpenMP, never
    loaded: a truncated shared object kills the loading process with SIGBUS. Each load runs in a child process
    (so a crash fails this test rather than pytest), and the damage is done while no process has the file mapped.

    $CC is a stand-in compiler that logs its arguments and copies the module's real build (``fn``) to its ``-o``
    path, so every rebuild is seen (and a real 15 s compile is not repeated): an intact cache is loaded without
    a build, each damaged one is rebuilt exactly once, with -fopenmp, and the rebuilt file is the good kernel."""
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    good = sorted(kernel_dir.glob("lora_sgmv-*.so"))[-1]  # the -omp build sorts last when there is one
    calls = tmp_path / "cc-calls.txt"
    fake_cc = tmp_path / "fake cc.sh"  # a space in the path: $CC is shlex-split
    fake_cc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "fake-cc 1.0"; exit 0; fi\n'
        f'echo "$*" >> {shlex.quote(str(calls))}\n'
        'out=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f'exec cp {shlex.quote(str(good))} "$out"\n'
    )
    fake_cc.chmod(0o755)
    cache = tmp_path / "cache"
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from pathlib import Path
from gpu_worker.lora_kernel import LOAD_NOTES, load_sgmv
d = Path({str(cache)!r})
for _ in range(int(sys.argv[1])):  # each time from the cache folder, as a fresh process would
    load_sgmv.cache_clear()
    fn = load_sgmv(d)
print("no-kernel" if fn is None else "ok " + LOAD_NOTES[d])
"""
    env = dict(os.environ, CC=shlex.quote(str(fake_cc)))
    env.pop("LOOM_MARCH", None)  # the fake compiler only copies a build: it cannot answer LOOM_MARCH's check

    stderr = []

    def load(times: int = 1) -> str:
        cmd = [sys.executable, "-c", code, str(times)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
        stderr.append(out.stderr)
        return out.stdout.strip()

    def builds() -> list[str]:
        return calls.read_text().splitlines() if calls.exists() else []

    assert load(times=2) == "ok" and len(builds()) == 1  # the first load builds, the second loads it as is
    assert "rebuilding" not in stderr[-1]
    [so] = cache.glob("lora_sgmv-*-omp.so")
    for damage in (lambda: os.truncate(so, so.stat().st_size // 3), lambda: so.write_bytes(b"garbage")):
        damage()
        n = len(builds())
        assert load() == "ok", "not rebuilt with OpenMP"  # an empty note: the OpenMP build, not single-threaded
        assert "does not match its recorded sha256: rebuilding it" in stderr[-1]  # said, not silent
        assert len(builds()) == n + 1 and "-fopenmp" in builds()[-1].split(), builds()
        assert so.read_bytes() == good.read_bytes()


def test_compiler_command_with_arguments_and_failure_messages(tmp_path, monkeypatch):
    """$CC may carry arguments (``ccache gcc``); a compiler that fails is named as such, not as missing."""
    import shutil

    cpu = torch.device("cpu")
    gcc = shutil.which("gcc") or shutil.which("cc")
    try:
        if gcc:
            monkeypatch.setenv("CC", f"{gcc} -pipe")
            load_sgmv.cache_clear()
            assert load_sgmv(tmp_path / "a") is not None
        monkeypatch.setenv("CC", "/bin/false")
        load_sgmv.cache_clear()
        fn, how = choose_backend("auto", torch.float32, cpu, tmp_path / "b")
        assert fn is None and "/bin/false does not run" in how, how
        with pytest.raises(RuntimeError, match="/bin/false does not run"):
            choose_backend("cpu-sgmv", torch.float32, cpu, tmp_path / "b")
    finally:
        load_sgmv.cache_clear()
