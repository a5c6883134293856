"""Same-host shared-memory all-reduce for CPU TP ranks (gloo costs about 1 ms per call here; this, tens of µs).

Layout of the one shared segment per TP group (``W`` ranks, ``S`` = ``slot_bytes``)::

    [0, 4096)            header: rank r's int64 sequence counter at byte r*128 (own cache lines, no false
                         sharing), then its op tags for buffers 0 and 1 (elements * 16 + dtype code), then its
                         reduce-scatter "done" counter; the int64 at byte W*128 is a setup token proving every
                         rank maps the same memory
    [4096, 4096 + 2WS)   data: buffer b (0 or 1), rank r's slot at 4096 + (b*W + r)*S
    [.., .. + 2S)        results: buffer b's shared result at 4096 + 2WS + b*S (large ops with 3+ ranks only)

One all-reduce op (sequence number ``s = 1, 2, ...``; a tensor over ``S`` bytes is cut into ops of ``S`` bytes)::

    copy my chunk into slot[s % 2][me];  tag[s % 2][me] = (numel, dtype);  counter[me] = s   (publish)
    wait until counter[r] >= s for every peer r; check tag[s % 2][r] == mine   (the op's only barrier)
    out = slot[s%2][0] + slot[s%2][1] + ... + slot[s%2][W-1]    (rank order, on every rank)

Large ops (``RS_MIN_BYTES`` or more) with 3+ ranks reduce-scatter instead, so that each element is summed once,
not once per rank (that matters with more ranks than cores): after the barrier above, rank r sums only its 1/W
of the elements into the shared ``result[s % 2]``, publishes ``done[r] = s``, waits for every ``done >= s`` and
copies the whole result out. Same sum order, so the same bits as the small path.

Why one barrier per op (two for a reduce-scatter) suffices with two buffers (``b = s % 2``):
- *Readers see complete data.* A rank publishes ``counter = s`` only after its copy into slot ``b`` returned, and
  x86-64 is TSO: stores become visible to other cores in program order and loads are not reordered with older
  loads, so a rank that reads ``counter[r] >= s`` and then reads slot ``b`` sees rank r's op-``s`` data (torch's
  copy may run on OpenMP threads, but it joins them, a full fence, before the counter store). Python gives no
  fences, so this is only safe on x86-64: other architectures use gloo (see :func:`select_all_reduce`).
- *No one overwrites a slot that is still being read.* Rank r next writes slot ``b`` at op ``s + 2``, which it
  starts only after passing op ``s + 1``'s barrier, i.e. after every rank published ``s + 1``; a rank publishes
  ``s + 1`` only after it finished summing op ``s``. So every read of op ``s`` ends before the slot is reused.
- *Counters never run ahead by more than one*, for the same reason, so ``counter[r] >= s`` is the right test.
- The tags and the reduce-scatter results are double-buffered like the slots, so the same argument covers them
  (``result[b]`` is next written at op ``s + 2``, after that op's barrier, when every rank has left op ``s``).
  A rank whose op differs (one that skipped an all-reduce after a local error would pair its next op with a
  peer's older one) is reported as out of step instead of summing unrelated data (a skipped op of the same
  size cannot be told apart, as with gloo).
- A reduce-scatter op's second wait (``done[r] >= s``) is safe the same way: ``done[r]`` cannot pass ``s`` before
  this rank publishes ``counter = s + 1``, and ``result[b]`` is read only after every ``done[r] >= s``.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import platform
import re
import secrets
import select
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("gpu_worker")

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "loom-ar-"
DEFAULT_SLOT_BYTES = 4 << 20  # per rank per buffer: [T, 576] bf16 up to T = 3640 in one op; larger ones are chunked
HEADER_BYTES = 4096
RS_MIN_BYTES = 256 << 10  # ops this large reduce-scatter when there are 3+ ranks
COUNTER_STRIDE = 128  # bytes between ranks' counters: separate cache lines (and adjacent-line prefetch pairs)
MAX_RANKS = (HEADER_BYTES - 8) // COUNTER_STRIDE
ENV_MODE = "LOOM_TP_ALLREDUCE"  # auto | shm | gloo

_SPIN_CHECKS = 400  # pure spins before yielding the CPU (a few tens of µs: peers usually arrive by then)
_YIELD_S = 0.005  # then sched_yield until this long
_SLEEP_S = 0.0005  # then sleep this long per check (a stopped or very slow peer must not cost a whole core)
_LIVENESS_EVERY_S = 0.05  # how often a waiting rank checks that the peer it waits for is still alive
_ACC_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_SUMMABLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_SUMMABLE)}
_Q = COUNTER_STRIDE // 8  # int64 words per rank's header line


class ShmAllReduceError(RuntimeError):
    """The shared-memory all-reduce cannot go on: a peer rank is gone (exited) or never arrived in time.

    The text always contains ``shm all-reduce`` and names the missing rank; ``gpu_worker.main`` treats it like a
    gloo error from a vanished peer (the launcher replaces the whole TP group).
    """


class ShmUnavailable(RuntimeError):
    """The ranks could not map one shared segment (e.g. different hosts or IPC namespaces); use gloo instead."""


def _pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if unknown): pids are comparable only within one namespace."""
    try:
        m = re.search(r"\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def _h64(text: str) -> int:
    """A non-negative 63-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _gather_ints(values: list[int], group: object | None) -> list[list[int]]:
    """All-gather a short list of int64 per rank over ``group`` (plain tensors, no pickle): ``[world][len]``."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [o.tolist() for o in out]


def _all_ok(ok: bool, group: object | None) -> bool:
    """Whether ``ok`` holds on every rank (one gloo all-reduce: also a barrier)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (missing or a zombie) according to /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _sweep_stale_names(pidns: int) -> None:
    """Remove ``/dev/shm/loom-ar-<pidns>-<pid>-...`` names of this PID namespace whose creator is dead.

    Such a name is left only by a start-up killed between creating and unlinking it (milliseconds).
    """
    try:
        names = [p for p in SHM_DIR.iterdir() if p.name.startswith(NAME_PREFIX)]
    except OSError:
        return
    for p in names:
        m = re.match(re.escape(NAME_PREFIX) + r"(\d+)-(\d+)-", p.name)
        if m and pidns and int(m.group(1)) == pidns and _process_gone(int(m.group(2))):
            try:
                p.unlink()
                log.warning("removed %s, left by a dead process", p)
            except OSError:
                pass


class ShmAllReduce:
    """In-place sum of a tensor over the ranks of one TP group on one host, through one shared segment.

    Build it on every rank of ``group`` at the same point (it runs a few gloo collectives); then every rank calls
    :meth:`all_reduce` with tensors of the same shape and dtype in the same order, like ``dist.all_reduce``.

    Args:
        group: the gloo process group (``None`` = the default group). Ranks are the group's ranks.
        slot_bytes: bytes each rank stages per op; larger tensors are reduced in chunks of this size. Shared
            memory used: ``2 * world * slot_bytes`` (+ 4 KiB), plus a private fp32 scratch for bf16/fp16.
        timeout_s: how long one op waits for a peer before raising :class:`ShmAllReduceError` (a dead peer is
            noticed within about 50 ms instead, where its pid can be watched).
        epoch: the TP group's epoch, only used in the fallback segment name.
        method: ``auto`` (memfd, else a named /dev/shm file), ``memfd`` or ``named`` (tests).

    Raises:
        ShmUnavailable: some rank could not map the segment (the same answer on every rank).
        ValueError: ``slot_bytes`` not a positive multiple of 64, or more than ``MAX_RANKS`` ranks.
    """

    def __init__(
        self,
        group: object | None = None,
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 300.0,
        epoch: int = 0,
        method: str = "auto",
    ) -> None:
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world > MAX_RANKS:
            raise ValueError(f"shm all-reduce supports at most {MAX_RANKS} ranks, got {self.world}")
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.method = ""
        self._seq = 0
        self._broken = ""
        self._size = HEADER_BYTES + 2 * self.world * slot_bytes + (2 * slot_bytes if self.world > 2 else 0)
        self._ids: list[list[int]] = []  # per rank: [pid, pid namespace inode, setup token]
        self._mm: mmap.mmap | None = None
        self._mm = self._attach(group, epoch, method)
        self._counters = memoryview(self._mm)[:HEADER_BYTES].cast("q")
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._slots = [
            [raw[self._slot_offset(b, r) : self._slot_offset(b, r) + slot_bytes] for r in range(self.world)]
            for b in (0, 1)
        ]
        res = HEADER_BYTES + 2 * self.world * slot_bytes
        self._results = [raw[res + b * slot_bytes : res + (b + 1) * slot_bytes] for b in (0, 1)]
        if self.world == 2:
            self._results = []  # not mapped (no reduce-scatter with two ranks)
        self._acc: torch.Tensor | None = None  # fp32 scratch for bf16/fp16 with 3+ ranks (lazy)
        self._views: dict[tuple[torch.dtype, int], tuple] = {}  # (dtype, numel) -> slot views, reused per shape
        self._peers = [r for r in range(self.world) if r != self.rank]
        self._peer_pid: dict[int, int] = {}
        self._pidfd: dict[int, int] = {}
        self._watch_peers()

    # ---------------------------------------------------------------- setup
    def _slot_offset(self, buf: int, rank: int) -> int:
        return HEADER_BYTES + (buf * self.world + rank) * self.slot_bytes

    def _attach(self, group: object | None, epoch: int, method: str) -> mmap.mmap:
        """Create (rank 0) or open (others) the segment and map it; every rank returns the same answer."""
        if method not in ("auto", "memfd", "named"):
            raise ValueError(f"method must be auto, memfd or named, got {method!r}")
        token = secrets.randbits(62) + 1
        self._ids = _gather_ints([os.getpid(), _pid_namespace(), token], group)
        reasons: list[str] = []
        if method in ("auto", "memfd"):
            mm = self._attach_memfd(group, reasons)
            if mm is not None:
                self.method = "memfd"
                return mm
        if method in ("auto", "named"):
            mm = self._attach_named(group, epoch, reasons)
            if mm is not None:
                self.method = "named"
                return mm
        raise ShmUnavailable("shm all-reduce: the ranks could not share a segment: " + "; ".join(reasons))

    def _check_token(self, mm: mmap.mmap) -> bool:
        """Whether the mapping holds rank 0's setup token (proves it is the memory rank 0 created)."""
        want = self._ids[0][2]
        return int.from_bytes(mm[self.world * COUNTER_STRIDE : self.world * COUNTER_STRIDE + 8], "little") == want

    def _new_mapping(self, fd: int) -> mmap.mmap:
        """Size (rank 0) and map the segment behind ``fd``; rank 0 writes its token."""
        if self.rank == 0:
            os.ftruncate(fd, self._size)
        mm = mmap.mmap(fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if self.rank == 0:
            off = self.world * COUNTER_STRIDE
            mm[off : off + 8] = self._ids[0][2].to_bytes(8, "little")
        return mm

    def _attach_memfd(self, group: object | None, reasons: list[str]) -> mmap.mmap | None:
        """memfd on rank 0, opened by the peers through /proc/PID/fd: never a name anywhere."""
        mm = None
        fd = -1
        fds = [-1]
        err = ""
        try:
            if self.rank == 0:
                fd = os.memfd_create("loom-allreduce", os.MFD_CLOEXEC)
                mm = self._new_mapping(fd)
                fds = [fd]
        except (OSError, AttributeError, ValueError) as e:
            err = f"rank 0: memfd_create: {e}"
        fd0 = torch.tensor(fds, dtype=torch.int64)
        dist.broadcast(fd0, group_src=0, group=group)
        if self.rank != 0 and fd0.item() >= 0:
            pid0 = self._ids[0][0]
            try:
                fd = os.open(f"/proc/{pid0}/fd/{fd0.item()}", os.O_RDWR | os.O_CLOEXEC)
                mm = self._new_mapping(fd)
                if not self._check_token(mm):
                    err = f"rank {self.rank}: /proc/{pid0}/fd/{fd0.item()} is not rank 0's segment"
            except OSError as e:
                err = f"rank {self.rank}: open /proc/{pid0}/fd/{fd0.item()}: {e}"
        ok = _all_ok(mm is not None and not err, group)  # rank 0 keeps its fd open until every peer opened it
        if fd >= 0:
            os.close(fd)  # the mapping keeps the memory alive
        if ok:
            return mm
        if mm is not None:
            mm.close()
        reasons.append(err or f"memfd failed on another rank than {self.rank}")
        return None

    def _attach_named(self, group: object | None, epoch: int, reasons: list[str]) -> mmap.mmap | None:
        """A named /dev/shm file, unlinked as soon as every rank has it mapped."""
        pid0, ns0, token = self._ids[0]
        path = SHM_DIR / f"{NAME_PREFIX}{ns0}-{pid0}-e{epoch}-{token:x}"
        mm = None
        err = ""
        fd = -1
        if self.rank == 0:
            _sweep_stale_names(ns0)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                mm = self._new_mapping(fd)
            except OSError as e:
                err = f"rank 0: create {path}: {e}"
        created = _all_ok(not err, group)
        if self.rank != 0 and created:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                mm = self._new_mapping(fd)
                if not self._check_token(mm):
                    err = f"rank {self.rank}: {path} is not rank 0's segment (another /dev/shm?)"
            except OSError as e:
                err = f"rank {self.rank}: open {path}: {e}"
        ok = _all_ok(created and mm is not None and not err, group)  # every rank has it mapped (or gave up)
        if self.rank == 0 and fd >= 0:
            try:
                path.unlink()
            except OSError:
                pass
        if fd >= 0:
            os.close(fd)
        if ok:
            return mm
        if mm is not None:
            mm.close()
        reasons.append(err or f"named segment failed on another rank than {self.rank}")
        return None

    def _watch_peers(self) -> None:
        """Open a pidfd per peer (same PID namespace only) so a waiting rank notices a dead peer at once."""
        my_ns = self._ids[self.rank][1]
        for r in self._peers:
            pid, ns, _ = self._ids[r]
            if not my_ns or ns != my_ns:
                continue
            self._peer_pid[r] = pid
            try:
                self._pidfd[r] = os.pidfd_open(pid)
            except (OSError, AttributeError):
                pass  # /proc polling instead

    def _peer_dead(self, r: int) -> bool:
        fd = self._pidfd.get(r)
        if fd is not None:
            return bool(select.select([fd], [], [], 0)[0])  # a pidfd is readable once the process exited
        pid = self._peer_pid.get(r)
        return pid is not None and _process_gone(pid)

    # ---------------------------------------------------------------- the op
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group's ranks, in place; every rank ends with bit-identical values.

        Args:
            t: a contiguous CPU tensor of any shape (fp32, bf16, fp16, fp64, int32 or int64), the same shape and
                dtype on every rank.

        Raises:
            ShmAllReduceError: a peer died, did not arrive within ``timeout_s``, or reduces another shape or dtype
                in the same op (names the rank); after that every further call raises too (the ranks are out of
                step for good).
            TypeError, ValueError: an unsupported dtype, or a non-contiguous or non-CPU tensor.
        """
        if self.world == 1:
            return
        if self._broken:
            raise ShmAllReduceError(self._broken)
        if t.dtype not in _SUMMABLE:
            raise TypeError(f"shm all-reduce: unsupported dtype {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("shm all-reduce needs a contiguous CPU tensor")
        flat = t.view(-1)
        n = flat.numel()
        per = self.slot_bytes // flat.element_size()
        if n <= per:
            self._op(flat)
            return
        for start in range(0, n, per):
            self._op(flat[start : start + per])

    def gather_columns(self, part: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Rank 0 receives every rank's columns: rank r holds ``part`` ``[B, hi_r - lo_r]`` of a ``[B, width]``
        matrix (``spans[r] = (lo_r, hi_r)``, the same list on every rank, tiling ``[0, width)``); rank 0 returns
        the whole ``[B, width]``, the other ranks their own ``part``.

        Half the memory traffic of zero-filling the whole matrix on every rank and summing it (the vocab-parallel
        LM head's logits: only rank 0 samples). Same barrier protocol as :meth:`all_reduce` (every rank publishes
        and waits for every peer, one op per chunk of rows), so the two kinds of op can follow each other freely;
        a peer that does the other kind of op at the same step is reported as out of step.

        Raises:
            ShmAllReduceError: as :meth:`all_reduce`.
            TypeError, ValueError: an unsupported dtype, a part whose width is not its span, or a non-contiguous
                or non-CPU tensor.
        """
        if self._broken:
            raise ShmAllReduceError(self._broken)
        lo, hi = spans[self.rank]
        if part.dim() != 2 or part.shape[1] != hi - lo:
            raise ValueError(f"shm gather: part {tuple(part.shape)} for columns [{lo}, {hi})")
        if part.dtype not in _SUMMABLE:
            raise TypeError(f"shm gather: unsupported dtype {part.dtype}")
        if part.device.type != "cpu" or not part.is_contiguous():
            raise ValueError("shm gather needs a contiguous CPU tensor")
        if self.world == 1:
            return part
        rows, width = part.shape[0], spans[-1][1]
        size = part.element_size()
        widest = max(b - a for a, b in spans)
        # ops of rows [r0, r1) x span columns [c0, c0 + cols): alike on every rank (the spans are), each rank's
        # piece at most slot_bytes (a narrower span's piece may be empty)
        cols = max(1, min(widest, self.slot_bytes // size))
        per = max(1, self.slot_bytes // (cols * size))
        out = torch.empty(rows, width, dtype=part.dtype) if self.rank == 0 else part
        if self.rank == 0:
            out[:, lo:hi] = part
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            for c0 in range(0, widest, cols):
                piece = part[r0:r1, c0 : c0 + cols]
                self._gather_op(piece, out[r0:r1] if self.rank == 0 else None, spans, c0, cols, r1 * width + c0)
        return out

    def _gather_op(
        self, x: torch.Tensor, out: torch.Tensor | None, spans: list[tuple[int, int]], c0: int, cols: int, n: int
    ) -> None:
        """One barrier-synchronised op of :meth:`gather_columns`: ``x`` is this rank's piece (rows of its span's
        columns ``[c0, c0 + cols)``, at most ``slot_bytes``), ``out`` rank 0's rows of the whole matrix (else None),
        ``n`` a number every rank computes alike for the op's tag."""
        s = self._seq + 1
        b = s & 1
        size = x.element_size()
        if out is None and x.numel():
            self._slots[b][self.rank][: x.numel() * size].view(x.dtype).view(x.shape).copy_(x)
        self._publish_and_wait(s, -(n * 16 + _DTYPE_CODE[x.dtype]), n, x.dtype)  # negative tag: a gather
        if out is None:
            return
        for r in self._peers:
            lo, hi = spans[r]
            w = min(hi - lo - c0, cols)
            if w > 0:
                rows = x.shape[0]
                out[:, lo + c0 : lo + c0 + w] = self._slots[b][r][: rows * w * size].view(x.dtype).view(rows, w)

    def _views_for(self, dtype: torch.dtype, n: int) -> tuple:
        """Views for an op of ``n`` elements of ``dtype``, cached per (dtype, n).

        Returns ``(slots [buf][rank], acc, rs)``: slot views of ``n`` elements; the fp32 scratch (bf16/fp16 with
        3+ ranks) or None; for a reduce-scatter op ``(results [buf] of n, [lo, hi) of this rank)``, else None.
        """
        key = (dtype, n)
        v = self._views.get(key)
        if v is None:
            size = torch.empty(0, dtype=dtype).element_size()
            slots = [[s[: n * size].view(dtype) for s in bufs] for bufs in self._slots]
            rs = None
            lo, hi = 0, n
            if self.world > 2 and n * size >= RS_MIN_BYTES:
                per = -(-n // (self.world * 32)) * 32  # this rank's share, in whole 64+ byte lines
                lo, hi = min(n, self.rank * per), min(n, (self.rank + 1) * per)
                rs = ([r[: n * size].view(dtype) for r in self._results], lo, hi)
            acc = None
            if dtype in _ACC_DTYPE and self.world > 2:
                if self._acc is None:
                    self._acc = torch.empty(self.slot_bytes // 2, dtype=torch.float32)
                acc = self._acc[: hi - lo]
            if len(self._views) > 256:  # shapes vary with the batch; keep the cache bounded
                self._views.clear()
            v = self._views[key] = (slots, acc, rs)
        return v

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor, acc: torch.Tensor | None) -> None:
        """``out = parts[0] + parts[1] + ...`` in rank order (every rank and path: the same bits)."""
        if acc is None:
            # fp32 etc. sum in their dtype; with two ranks bf16/fp16 add in fp32 and round once inside the kernel
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)
        else:
            acc.copy_(parts[0])
            for p in parts[1:]:
                acc.add_(p)
            out.copy_(acc)

    def _op(self, x: torch.Tensor) -> None:
        """One barrier-synchronised reduction of the 1-D ``x`` (at most ``slot_bytes``), in place."""
        s = self._seq + 1
        b = s & 1
        n = x.numel()
        slots, acc, rs = self._views_for(x.dtype, n)
        mine = slots[b]
        mine[self.rank].copy_(x)
        self._publish_and_wait(s, n * 16 + _DTYPE_CODE[x.dtype], n, x.dtype)
        counters = self._counters
        if rs is None:
            self._sum(mine, x, acc)
            return
        results, lo, hi = rs
        if hi > lo:
            self._sum([m[lo:hi] for m in mine], results[b][lo:hi], acc)
        counters[self.rank * _Q + 3] = s  # done: my share of result[b] is written (after the data, TSO)
        for r in self._peers:
            if counters[r * _Q + 3] < s:
                self._wait(r, s, word=3)
        x.copy_(results[b])

    def _publish_and_wait(self, s: int, tag: int, n: int, dtype: torch.dtype) -> None:
        """Op ``s``'s barrier (after this rank's data is in its slot): publish the tag, then the counter, and wait
        until every peer has published op ``s`` with the same tag (else :meth:`_out_of_step`)."""
        counters, b = self._counters, s & 1
        counters[self.rank * _Q + 1 + b] = tag
        counters[self.rank * _Q] = s  # publish after the data and tag (x86 TSO: see the module doc)
        for r in self._peers:
            if counters[r * _Q] < s:
                self._wait(r, s)
            if counters[r * _Q + 1 + b] != tag:
                self._out_of_step(r, s, n, dtype, counters[r * _Q + 1 + b])
        self._seq = s

    def _wait(self, r: int, s: int, word: int = 0) -> None:
        """Wait until rank ``r``'s header ``word`` (0: op counter, 3: reduce-scatter done) reaches ``s``.

        Spins, then yields the CPU, then sleeps; raises :class:`ShmAllReduceError` if the peer dies or times out.
        """
        counters = self._counters
        i = r * _Q + word
        for _ in range(_SPIN_CHECKS):
            if counters[i] >= s:
                return
        start = time.monotonic()
        next_check = start + _LIVENESS_EVERY_S
        while counters[i] < s:
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()  # let a peer (or anything else) that shares this core run
            else:
                time.sleep(_SLEEP_S)  # a slow or stopped peer: stop burning a core
            if now < next_check:
                continue
            next_check = now + _LIVENESS_EVERY_S
            if counters[i] >= s:
                return
            if self._peer_dead(r):
                pid = self._peer_pid.get(r)
                self._broken = (
                    f"shm all-reduce: peer rank {r} (pid {pid}) is gone; rank {self.rank} waited for it at op {s}"
                )
                raise ShmAllReduceError(self._broken)
            if now - start > self.timeout_s:
                self._broken = (
                    f"shm all-reduce: rank {r} did not arrive within {self.timeout_s:g} s (rank {self.rank} "
                    f"waited at op {s}); the peer is hung or gone"
                )
                raise ShmAllReduceError(self._broken)

    def _out_of_step(self, r: int, s: int, n: int, dtype: torch.dtype, their: int) -> None:
        names = {code: dt for dt, code in _DTYPE_CODE.items()}
        theirs = f"{'gathers' if their < 0 else 'reduces'} {abs(their) // 16} elements of {names.get(abs(their) % 16)}"
        self._broken = (
            f"shm all-reduce: rank {r} is out of step with rank {self.rank} at op {s}: it {theirs}, this rank "
            f"{n} of {dtype}"
        )
        raise ShmAllReduceError(self._broken)

    def close(self) -> None:
        """Unmap the segment and close the pidfds (idempotent); later calls to :meth:`all_reduce` fail."""
        self._broken = self._broken or "shm all-reduce: closed"
        for fd in self._pidfd.values():
            os.close(fd)
        self._pidfd.clear()
        self._views.clear()
        self._slots = []
        self._results = []
        self._acc = None
        if self._mm is not None:
            self._counters.release()
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
            self._mm = None


def _mode_from_env() -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in ("auto", "shm", "gloo"):
        raise ValueError(f"{ENV_MODE}={mode!r}: choose auto, shm or gloo")
    return mode


def select_all_reduce(
    group: object | None, *, epoch: int = 0, timeout_s: float = 300.0, mode: str | None = None
) -> tuple[ShmAllReduce | None, str]:
    """Decide, identically on every rank of a CPU gloo group, between the shm all-reduce and gloo.

    shm needs every rank on one host (same hostname and boot id) and an x86-64 CPU (its TSO ordering makes the
    counter-after-data store safe from Python; see the module doc); otherwise, or if the segment cannot be shared,
    gloo stays. ``mode`` (default: env ``LOOM_TP_ALLREDUCE``, rank 0's value wins): ``auto``; ``gloo`` never uses
    shm; ``shm`` raises instead of falling back.

    Returns:
        ``(reducer or None for gloo, a one-line reason for the log)``.

    Raises:
        ShmUnavailable: ``mode == "shm"`` and shm cannot be used.
        ValueError: an unknown mode.
    """
    mode = mode or _mode_from_env()
    modes = ("auto", "shm", "gloo")
    if mode not in modes:
        raise ValueError(f"all-reduce mode {mode!r}: choose auto, shm or gloo")
    host = _h64(socket.gethostname() + "/" + _boot_id())
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    facts = _gather_ints([modes.index(mode), host, int(x86)], group)
    mode = modes[facts[0][0]]
    why = ""
    if mode == "gloo":
        return None, f"gloo ({ENV_MODE}=gloo)"
    if len({f[1] for f in facts}) > 1:
        why = "the TP ranks are on different hosts"
    elif not all(f[2] for f in facts):
        why = f"not every rank runs on x86-64 (this one: {platform.machine()}); shm ordering relies on x86 TSO"
    if not why:
        try:
            shm = ShmAllReduce(group, timeout_s=timeout_s, epoch=epoch)
        except ShmUnavailable as e:
            why = str(e)
        else:
            size_mib = shm._size / (1 << 20)
            return shm, f"shm ({shm.method} segment, {shm.world} ranks, {size_mib:.1f} MiB)"
    if mode == "shm":
        raise ShmUnavailable(f"{ENV_MODE}=shm but {why}")
    return None, f"gloo ({why})"
