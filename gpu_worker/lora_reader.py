"""Adapter weight files read on a background thread, so that a load from disk does not stall the decode steps.

A worker runs one loop: a ``WorkerLoraLoad`` handled in line stops every running request for as long as the
rank takes to read the adapter's ``adapter_model.safetensors``: ~1.3 ms for a 1.4 MB q/v adapter on this
machine's virtual disk, but a rank-64 adapter on all seven linears of an 8B model is ~170 MB, and on network
storage a read can take seconds. Here the read (plain file I/O, which releases the GIL) runs on one thread of
its own while the loop goes on with its steps; the loop then validates and lays out the bytes
(``LoraPool.load``) on its own thread, in the order the loads arrived. A file the page cache holds is read at
once instead (~0.3 ms for 1.4 MB here): handed to the thread, its load would wait for the loop's next step to
end (a step already sent runs first), which added ~20 ms to those requests' time to first token in
``bench/many_adapters.py``. The idea of overlapping adapter loading with the batch's compute is S-LoRA's
(arXiv 2311.03285), which prefetches adapter weights while decoding.

Nothing else changes for the scheduler: a load is still acked only once this rank holds the adapter, and it
sends no step naming an adapter before every rank acked it. The loop finishes every load in flight before it
handles an unload, a pinned load (which takes a slot, and slot decisions must happen at the same point of the
message stream on every TP rank) or a scheduler's hello (whose reply lists the host tier).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ipc.lora_config import WEIGHTS_FILE, LoraConfigError, read_adapter_file
from ipc.messages import WorkerLoraLoad


def read_weights_file(folder: str | Path, root: str | Path | None = None) -> bytes | None:
    """The bytes of ``folder``'s adapter weights file, or None when it cannot be read or lies outside ``root``
    (``--lora-root``; the caller reads again to name the problem: :func:`ipc.lora_config.read_adapter_file`)."""
    try:
        return read_adapter_file(folder, WEIGHTS_FILE, "", root)
    except (LoraConfigError, MemoryError):
        return None


def in_page_cache(path: Path) -> bool:
    """Whether ``path``'s first, middle and last pages are in the page cache (so reading it will not wait on the
    disk): three 1-byte ``preadv`` with ``RWF_NOWAIT`` (Linux 4.14+), which fail rather than wait. A file cached
    only in part may read as cached; False where the flag is missing or refused, or the file cannot be opened."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block this probe (it is no file)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False  # a FIFO or device: its read may block (LoraPool.load then names what it is)
        buf, size = bytearray(1), st.st_size
        return all(os.preadv(fd, [buf], off, flag) == 1 for off in {0, size // 2, size - 1}) if size else True
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP: a file system without the flag
        return False
    finally:
        os.close(fd)


class AdapterReader:
    """Reads adapters' weight files on one background thread, handing them back in the order they were asked for.

    ``fileno()`` is a pipe's read end that becomes readable when a read finished (for ``zmq.Poller``, next to
    the worker's socket); :meth:`ready` returns the loads whose file was read, oldest first, stopping at the
    first one still reading, and :meth:`drain` waits for all of them. A read that fails hands back None.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self._root = root  # --lora-root: files outside it are not read (the load then names why)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._pending: deque[tuple[WorkerLoraLoad, Future[bytes | None]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        """The pipe end to poll: readable once a read finished."""
        return self._wake_r

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, msg: WorkerLoraLoad) -> None:
        """Read ``msg.path``'s weights file: at once when the page cache holds it (a fraction of a ms, and the load
        is then ready before the loop's next step, as if read in line), else on the reader thread."""
        if in_page_cache(Path(msg.path) / WEIGHTS_FILE):
            fut: Future[bytes | None] = Future()
            fut.set_result(read_weights_file(msg.path, self._root))
        else:
            fut = self._pool.submit(read_weights_file, msg.path, self._root)
        fut.add_done_callback(self._wake)
        self._pending.append((msg, fut))

    def _wake(self, _fut: Future) -> None:
        with self._lock:  # never write to a closed pipe's fd number, which the process may have reused since
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # full: the loop has wake-ups to read already
                pass

    def _clear_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def ready(self) -> list[tuple[WorkerLoraLoad, bytes | None]]:
        """The loads whose file was read, in arrival order (up to the first one still reading)."""
        self._clear_wake()
        out = []
        while self._pending and self._pending[0][1].done():
            msg, fut = self._pending.popleft()
            out.append((msg, fut.result()))
        return out

    def drain(self) -> list[tuple[WorkerLoraLoad, bytes | None]]:
        """Every load in flight, in arrival order, once its file was read."""
        out = [(msg, fut.result()) for msg, fut in self._pending]
        self._pending.clear()
        self._clear_wake()
        return out

    def close(self) -> None:
        """Stop the thread (reads not started are dropped; one under way finishes unseen) and close the pipe."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
