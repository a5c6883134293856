"""Where a served decode step's time goes, base against mixed-LoRA steps, timed inside the cluster's own worker.

``bench/decode_step.py`` times one worker in-process; a served cluster can behave differently (its plans are
sorted by adapter, its KV slots and prefix cache come from the scheduler, its traffic arrives over sockets). This
module installs a ``sitecustomize.py`` hook into the cluster's ``gpu_worker`` processes (children inherit
``PYTHONPATH``) that wraps, with ``time.perf_counter``, every phase of a pure decode step of at least
``min_rows`` rows: the four base GEMMs of each layer (``mm_qkv``, ``mm_o``, ``mm_gate_up``, ``mm_down``; the
LM head's is ``mm_other``, inside ``logits``), the bound C layer ops and decode attention (``add_rms_norm``,
``rope_attend``, ``silu_mul``), each fused LoRA apply (``lora_qkv`` ...), the batch's LoRA preparation and input
packing, and the whole ``Worker.step``. A step counts as ``mixed`` when any row names an adapter, else ``base``.
Each rank writes ``phases-PID.json`` (milliseconds per step, averaged) after every counted step, and appends
every step, of any kind, to ``trace-PID.jsonl`` (``[mode, rows, decode rows, input tokens, ms]``): how each burst of
traffic started (``burst_starts``).

With ``skip_lora`` the LoRA applies return at once (wrong tokens, right timing of everything else): what a mixed
batch costs outside the LoRA arithmetic (its plan order, its traffic).

    from step_phases import phase_env, phase_table
    os.environ.update(phase_env(folder))   # before the cluster starts
    ...                                    # serve base and mixed traffic
    print(phase_table(folder))

``bench/multi_lora.py --phases`` does this around its runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from import_hook import patch_on_import  # noqa: E402

_PATCH = """
import json as _json
import os as _os
import sys as _sys
import time as _time


def _patch(mod):
    if not _sys.argv[0].endswith(_os.path.join("gpu_worker", "main.py")):
        return
    import gpu_worker.bound_decode as bd
    import gpu_worker.lora_pool as lp
    import gpu_worker.model as gm

    out_dir = _os.environ["LOOM_PHASES_DIR"]
    min_rows = int(_os.environ.get("LOOM_PHASES_MIN_ROWS", "48"))
    st = {"mode": None, "mm": 0}
    acc = {"base": {}, "mixed": {}}
    steps = {"base": 0, "mixed": 0}
    perf = _time.perf_counter

    def timed(key, fn):
        def wrapper(*a, **k):
            if st["mode"] is None:
                return fn(*a, **k)
            t = perf()
            try:
                return fn(*a, **k)
            finally:
                name = key(a)
                acc[st["mode"]][name] = acc[st["mode"]].get(name, 0.0) + perf() - t
        return wrapper

    mm_lora = gm.LlamaShard._mm_lora

    def in_module(self, x, w, lora, layer, module):  # names the layer GEMMs _mm makes inside it
        st["cur"] = module
        try:
            return mm_lora(self, x, w, lora, layer, module)
        finally:
            st["cur"] = None

    gm.LlamaShard._mm_lora = in_module
    gm.LlamaShard._mm = timed(lambda a: "mm_" + (st.get("cur") or "other"), gm.LlamaShard._mm)
    gm.LlamaShard._logits = timed(lambda a: "logits", gm.LlamaShard._logits)
    gm.LlamaShard._bind_decode = timed(lambda a: "bind", gm.LlamaShard._bind_decode)
    for n in ("add_rms_norm", "rope_attend", "silu_mul"):
        setattr(bd.BoundDecode, n, timed(lambda a, n=n: n, getattr(bd.BoundDecode, n)))
    add = (lambda self, layer, fused, x, out: None) if _os.environ.get("LOOM_PHASES_SKIP_LORA") else lp.LoraBatch.add
    lp.LoraBatch.add = timed(lambda a: "lora_" + a[2], add)
    # the GEMM and the LoRA in one kernel call (lora_kernel.SgmvStep.mm_add), counted where it ran (not None);
    # skipped: None, so _mm and add run
    mm_add = lp.LoraBatch.mm_add

    def timed_mm_add(self, layer, fused, x, w):
        if _os.environ.get("LOOM_PHASES_SKIP_LORA"):
            return None
        t = perf()
        out = mm_add(self, layer, fused, x, w)
        if st["mode"] is not None and out is not None:
            name = "mm+lora_" + fused
            acc[st["mode"]][name] = acc[st["mode"]].get(name, 0.0) + perf() - t
        return out

    lp.LoraBatch.mm_add = timed_mm_add
    lp.LoraPool.prepare = timed(lambda a: "lora_prepare", lp.LoraPool.prepare)
    mod.Worker.build_inputs = timed(lambda a: "build_inputs", mod.Worker.build_inputs)
    step = mod.Worker.step

    kinds = {"base": {}, "mixed": {}}  # every step, by kind: [count, seconds]

    def timed_any(self, fb):
        t = perf()
        try:
            return timed_step(self, fb)
        finally:
            took = perf() - t
            mode = "mixed" if any(r.lora_uid for r in fb.reqs) else "base"
            ndec = sum(1 for r in fb.reqs if len(r.input_ids) == 1 and r.prefix_len)
            kind = "prefill or mixed"
            if ndec == len(fb.reqs):
                kind = ("decode >= %d rows" % min_rows) if ndec >= min_rows else "decode, fewer rows"
            c = kinds[mode].setdefault(kind, [0, 0.0])
            c[0] += 1
            c[1] += took
            ntok = sum(len(r.input_ids) for r in fb.reqs)
            with open(_os.path.join(out_dir, "trace-%d.jsonl" % _os.getpid()), "a") as f:
                f.write(_json.dumps([mode, len(fb.reqs), ndec, ntok, round(took * 1e3, 2)]) + "\\n")
            path = _os.path.join(out_dir, "kinds-%d.json" % _os.getpid())
            with open(path + ".tmp", "w") as f:
                _json.dump(kinds, f)
            _os.replace(path + ".tmp", path)

    def timed_step(self, fb):
        if len(fb.reqs) < min_rows or any(len(r.input_ids) != 1 or not r.prefix_len for r in fb.reqs):
            return step(self, fb)
        mode = "mixed" if any(r.lora_uid for r in fb.reqs) else "base"
        st["mode"], st["mm"] = mode, 0
        t = perf()
        try:
            return step(self, fb)
        finally:
            acc[mode]["step"] = acc[mode].get("step", 0.0) + perf() - t
            st["mode"] = None
            steps[mode] += 1
            res = {m: {k: v / steps[m] * 1e3 for k, v in acc[m].items()} if steps[m] else {} for m in acc}
            res["steps"] = dict(steps)
            path = _os.path.join(out_dir, "phases-%d.json" % _os.getpid())
            with open(path + ".tmp", "w") as f:
                _json.dump(res, f)
            _os.replace(path + ".tmp", path)

    mod.Worker.step = timed_any

"""
HOOK = patch_on_import("gpu_worker.worker", _PATCH)


def phase_env(folder: Path, skip_lora: bool = False, min_rows: int = 48) -> dict[str, str]:
    """Write the hook into ``folder`` and return the environment that makes a cluster started afterwards (or any
    process running ``gpu_worker/main.py``) time its decode steps of at least ``min_rows`` rows into ``folder``.

    ``PYTHONPATH`` keeps what it held, after ``folder``. Raises OSError if ``folder`` cannot be written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH", "")]))
    env = {"PYTHONPATH": path, "LOOM_PHASES_DIR": str(folder), "LOOM_PHASES_MIN_ROWS": str(min_rows)}
    if skip_lora:
        env["LOOM_PHASES_SKIP_LORA"] = "1"
    return env


def read_phases(folder: Path) -> list[dict]:
    """Every rank's ``phases-PID.json`` in ``folder``: ``{"base": {phase: ms per step}, "mixed": {...},
    "steps": {"base": n, "mixed": n}}``, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("phases-*.json"))]


def phase_table(folder: Path) -> str:
    """A table per rank: each phase's milliseconds per decode step, base and mixed, and mixed - base, largest
    first, then the sum of the phases' differences outside the LoRA applies against the whole step's."""
    lines = []
    for i, d in enumerate(read_phases(folder)):
        base, mixed, n = d["base"], d["mixed"], d["steps"]
        lines.append(f"rank file {i}: {n['base']} base and {n['mixed']} mixed decode steps timed (ms per step)")
        lines.append(f"  {'phase':<14} {'base':>8} {'mixed':>8} {'mixed-base':>11}")
        names = sorted(set(base) | set(mixed), key=lambda k: -max(base.get(k, 0.0), mixed.get(k, 0.0)))
        for k in names:
            b, m = base.get(k, 0.0), mixed.get(k, 0.0)
            lines.append(f"  {k:<14} {b:8.2f} {m:8.2f} {m - b:+11.2f}")
        lora = sum(mixed.get(k, 0.0) for k in names if k.startswith("lora_") and k != "lora_prepare")
        # a fused call's time, less the base step's GEMM of that projection
        lora += sum(mixed[k] - base.get("mm_" + k[8:], 0.0) for k in names if k.startswith("mm+lora_") and k in mixed)
        if base and mixed:
            rest = mixed["step"] - base["step"] - lora
            lines.append(f"  the LoRA applies {lora:.2f} ms; the rest of mixed - base {rest:+.2f} ms")
    for i, p in enumerate(sorted(folder.glob("trace-*.jsonl"))):
        lines.append(f"rank file {i}, each burst: its steps (with prefill), its first steps (rows/decode rows)")
        lines += ["  " + b for b in burst_starts([json.loads(ln) for ln in p.read_text().splitlines()])]
    for i, p in enumerate(sorted(folder.glob("kinds-*.json"))):
        kinds = json.loads(p.read_text())
        lines.append(f"rank file {i}, every step by kind (count, seconds in all; base / mixed):")
        for k in sorted(set(kinds["base"]) | set(kinds["mixed"])):
            (nb, sb), (nm, sm) = kinds["base"].get(k, (0, 0.0)), kinds["mixed"].get(k, (0, 0.0))
            lines.append(f"  {k:<20} {nb:5d} {sb:7.3f} s / {nm:5d} {sm:7.3f} s   mixed-base {sm - sb:+.3f} s")
    return "\n".join(lines) if lines else f"no decode steps were timed (no phases-*.json in {folder})"


def burst_rows(burst: list[list]) -> int:
    """The most rows any step of a burst ran (its full batch)."""
    return max(s[1] for s in burst)


def burst_starts(trace: list[list]) -> list[str]:
    """One line per burst in a step trace (``[mode, rows, decode rows, input tokens, ms]`` per step): a burst
    starts at a step of two or more rows after a one-row step (bench/multi_lora.py warms each adapter up with one
    request at a time) and ends before the next one-row step. A burst that reached the scheduler over several
    steps and then started one chunk a step shows as many steps with prefill and first steps that grow slowly."""
    out = []
    for k in range(1, len(trace)):
        if trace[k][1] < 2 or trace[k - 1][1] != 1:
            continue
        end = next((j for j in range(k + 1, len(trace)) if trace[j][1] == 1), len(trace))
        burst = trace[k:end]
        prefill = sum(1 for s in burst if s[2] < s[1])
        first = " ".join(f"{s[1]}/{s[2]}" for s in burst[:6])
        busy = sum(s[4] for s in burst) / 1e3
        pre = sum(s[4] for s in burst if s[2] < s[1]) / 1e3
        pre_tokens = sum(s[3] - s[2] for s in burst if s[2] < s[1])  # prompt tokens computed (not cached)
        full = [s[4] for s in burst if s[2] == s[1] and s[1] >= max(2, burst_rows(burst) * 3 // 4)]
        split = f"prefill {pre:.2f} s of {pre_tokens} tokens, {len(full)} full decode steps {sum(full) / 1e3:.2f} s"
        out.append(f"{burst[0][0]:<5} {len(burst):3d} steps ({prefill} with prefill), {busy:.2f} s ({split}): {first}")
    return out
