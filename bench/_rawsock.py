"""The raw-socket baselines of the peer-tier benchmarks: one Python TCP connection on loopback.

The sender ``sendfile``s a file (zero-copy from tmpfs). The receiver ``recv_into``s a reusable
4 MiB buffer and either discards it (the fastest a plain Python socket moves those bytes) or,
with ``to_dir``, ``pwrite``s it into a file there (a plain socket-to-file copy): a fresh file
per copy, or with ``warm`` one file rewritten in place, its pages touched by an untimed first
copy (what a receiver that reuses its pages, as the daemons do from their third step, pays).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

__all__ = ["raw_copy_seconds"]


def _receive(listener: socket.socket, nbytes: int, target: Path | None, out: list[float], keep: bool) -> None:
    conn, _ = listener.accept()
    buf = memoryview(bytearray(4 << 20))
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | (0 if keep else os.O_EXCL)) if target else -1
    got = 0
    with conn:
        while got < nbytes:
            n = conn.recv_into(buf, min(len(buf), nbytes - got))
            if not n:
                break
            if fd >= 0:
                os.pwrite(fd, buf[:n], got)
            got += n
        out.append(time.perf_counter())
        conn.sendall(b"k")
    if fd >= 0:
        os.close(fd)
        if not keep:
            os.unlink(target)


def raw_copy_seconds(path: str | os.PathLike, rounds: int = 3, to_dir: str | os.PathLike | None = None,
                     warm: bool = False) -> list[float]:
    """Seconds to move the file at ``path`` over one loopback TCP connection, per round (with
    ``to_dir``: into a file there; ``warm``: one file, first written by an untimed copy)."""
    nbytes = os.path.getsize(path)
    times = []
    kept = Path(to_dir) / f"raw-copy-{os.getpid()}-warm" if to_dir and warm else None
    try:
        for i in range(-1 if kept else 0, rounds):
            t = _copy_once(path, nbytes, kept or (Path(to_dir) / f"raw-copy-{os.getpid()}-{i}" if to_dir else None),
                           kept is not None)
            if i >= 0:
                times.append(t)
    finally:
        if kept is not None:
            kept.unlink(missing_ok=True)
    return times


def _copy_once(path: str | os.PathLike, nbytes: int, target: Path | None, keep: bool) -> float:
    """One timed copy of ``path`` (``nbytes``) into ``target`` (None: discarded)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        done: list[float] = []
        t = threading.Thread(target=_receive, args=(listener, nbytes, target, done, keep))
        t.start()
        with socket.create_connection(listener.getsockname()) as s, open(path, "rb") as fh:
            t0 = time.perf_counter()
            s.sendfile(fh)
            s.recv(1)
        t.join()
        return done[0] - t0
