"""gpu_worker.lora_reader: adapter weight files read off the worker's loop, handed back in arrival order."""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

import pytest

from gpu_worker.lora_reader import AdapterReader, in_page_cache, read_weights_file
from ipc.lora_config import WEIGHTS_FILE
from ipc.messages import WorkerLoraLoad


def _folder(tmp_path: Path, name: str, content: bytes | None) -> Path:
    """An adapter folder whose weights file holds ``content`` (None: a FIFO that blocks readers until written)."""
    d = tmp_path / name
    d.mkdir()
    if content is None:
        os.mkfifo(d / WEIGHTS_FILE)
    else:
        (d / WEIGHTS_FILE).write_bytes(content)
    return d


@pytest.fixture
def slow_files(monkeypatch):
    """A read of an empty weights file waits until something is written to it, and such a file never counts as
    cached: a read that lasts as long as the test wants. (A FIFO did this once; the worker now refuses FIFOs.)"""
    import gpu_worker.lora_reader as lr

    real_read, real_cached = lr.read_adapter_file, lr.in_page_cache

    def read(folder, fname, name, root=None):
        path, deadline = Path(folder) / fname, time.monotonic() + 30
        while path.is_file() and path.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_read(folder, fname, name, root)

    monkeypatch.setattr(lr, "read_adapter_file", read)
    monkeypatch.setattr(lr, "in_page_cache", lambda p: p.is_file() and p.stat().st_size > 0 and real_cached(p))


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_a_slow_read_blocks_neither_the_caller_nor_the_order(tmp_path, slow_files):
    slow, fast = _folder(tmp_path, "slow", b""), _folder(tmp_path, "fast", b"fast bytes")
    reader = AdapterReader()
    try:
        a = WorkerLoraLoad(1, "u1", "slow", str(slow))
        b = WorkerLoraLoad(2, "u2", "fast", str(fast))
        reader.submit(a)  # returns at once although nothing can be read yet
        reader.submit(b)  # a cached file: read at once
        assert len(reader) == 2
        time.sleep(0.2)
        assert reader.ready() == []  # b is never handed back before a, which came first
        with open(slow / WEIGHTS_FILE, "wb") as f:  # unblocks the reader thread
            f.write(b"slow bytes")
        assert _readable(reader.fileno(), 10.0)
        got: list = []
        for _ in range(100):  # b's read may finish just after the first wake-up
            got += reader.ready()
            if len(got) == 2:
                break
            _readable(reader.fileno(), 0.1)
        assert got == [(a, b"slow bytes"), (b, b"fast bytes")]
        assert len(reader) == 0
        assert not _readable(reader.fileno(), 0.0)  # ready() consumed the wake-ups
    finally:
        reader.close()


def test_drain_waits_for_every_read_in_order(tmp_path, slow_files):
    slow = _folder(tmp_path, "slow", b"")
    reader = AdapterReader()
    try:
        msgs = [WorkerLoraLoad(1, "u1", "slow", str(slow))]
        msgs += [WorkerLoraLoad(i, f"u{i}", f"a{i}", str(_folder(tmp_path, f"a{i}", bytes([i])))) for i in (2, 3)]
        for m in msgs:
            reader.submit(m)

        def write() -> None:
            with open(slow / WEIGHTS_FILE, "wb") as f:
                f.write(b"x")

        t = threading.Timer(0.2, write)
        t.start()
        assert reader.drain() == [(msgs[0], b"x"), (msgs[1], b"\x02"), (msgs[2], b"\x03")]
        t.join()
        assert len(reader) == 0 and reader.ready() == []
    finally:
        reader.close()


def test_an_unreadable_file_comes_back_as_none(tmp_path):
    reader = AdapterReader()
    try:
        m = WorkerLoraLoad(1, "u1", "gone", str(tmp_path / "gone"))
        reader.submit(m)
        assert reader.drain() == [(m, None)]  # LoraPool.load then reads again and names the missing file
        assert read_weights_file(tmp_path / "gone") is None
    finally:
        reader.close()


def test_close_with_a_read_in_flight_raises_nothing(tmp_path, slow_files):
    slow = _folder(tmp_path, "slow", b"")
    reader = AdapterReader()
    reader.submit(WorkerLoraLoad(1, "u1", "slow", str(slow)))
    reader.close()  # the read still blocks; its wake-up later meets a closed pipe and is dropped
    with open(slow / WEIGHTS_FILE, "wb") as f:
        f.write(b"x")
    reader._pool.shutdown(wait=True)  # the thread finished, its callback found the pipe closed


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT here: every read goes to the thread")
def test_a_cached_file_is_read_at_once_and_an_evicted_one_on_the_thread(tmp_path):
    d = _folder(tmp_path, "a", os.urandom(1 << 20))
    path = d / WEIGHTS_FILE
    if not in_page_cache(path):
        pytest.skip("this file system refuses RWF_NOWAIT reads")
    reader = AdapterReader()
    try:
        m = WorkerLoraLoad(1, "u1", "a", str(d))
        reader.submit(m)
        assert reader.ready() == [(m, path.read_bytes())]  # no wait at all: it was read in submit
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages must be clean to leave the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert not in_page_cache(path)
    finally:
        reader.close()
    fifo = _folder(tmp_path, "fifo", None) / WEIGHTS_FILE
    assert not in_page_cache(fifo)  # returns at once: a FIFO is never read in line
    assert read_weights_file(fifo.parent) is None  # nor read at all (it could block the worker for ever)
    assert not in_page_cache(tmp_path / "missing")
