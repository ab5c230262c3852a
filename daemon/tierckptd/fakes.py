"""In-memory stand-ins for tests of code that talks to a persistent-tier backend.

- :class:`MemoryBackend`: a complete :class:`~tierckptd.backends.base.Backend` held in a dict,
  with the contract of the real ones (key validation, atomic puts, ``get_file`` writing its path
  only on success, :class:`~tierckpt.errors.NotFoundError` for a missing key, ``OSError`` for an
  unreadable local file).
- :class:`FaultyBackend`: wraps any backend and, on demand, fails the next N calls of a method
  with a retryable or non-retryable :class:`~tierckptd.backends.base.BackendError`, holds calls
  of a method until released, or corrupts the bytes that reads return.

Both are thread-safe: the persistent tier calls them from many worker threads at once.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from tierckpt.errors import NotFoundError

from .backends.base import Backend, BackendError, atomic_local_file, check_key, check_limit, check_prefix, read_exactly

__all__ = ["MemoryBackend", "FaultyBackend"]


class MemoryBackend(Backend):
    """A backend whose objects live in this process (see the module docstring).

    Args:
        url: the name it reports (messages only).
        objects: the objects to serve (another instance's ``objects``: the same store opened
            again, e.g. by a restarted daemon); default: a new, empty store.

    Attributes:
        objects: key -> bytes (tests may read or change it directly).
    """

    def __init__(self, url: str = "memory://test/", objects: dict[str, bytes] | None = None) -> None:
        self.url = url
        self.objects: dict[str, bytes] = {} if objects is None else objects
        self.closed = False
        self._lock = threading.Lock()

    def _open(self) -> None:
        if self.closed:
            raise BackendError(f"{self.url}: backend is closed", retryable=False)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        check_key(key)
        self._open()
        data = Path(path).read_bytes()  # OSError for an unreadable file, as the contract says
        with self._lock:
            self.objects[key] = data

    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        check_key(key)
        self._open()
        data = b"".join(read_exactly(src, size))
        with self._lock:
            self.objects[key] = data

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        check_key(key)
        self._open()
        with self._lock:
            self.objects[key] = bytes(data)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        data = self.get_bytes(key)
        with atomic_local_file(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)

    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        check_key(key)
        self._open()
        with self._lock:
            data = self.objects.get(key)
        if data is None:
            raise NotFoundError(f"{self.url}{key} does not exist")
        check_limit(f"get {self.url}{key}", len(data), limit)
        return data

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        self._open()
        with self._lock:
            return sorted(k for k in self.objects if k.startswith(prefix))

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            check_key(key)
        self._open()
        with self._lock:
            for key in keys:
                self.objects.pop(key, None)

    def exists(self, key: str) -> bool:
        check_key(key)
        self._open()
        with self._lock:
            return key in self.objects

    def close(self) -> None:
        self.closed = True


class FaultyBackend(Backend):
    """Wraps ``inner`` and injects faults per method name (``"put_file"``, ``"get_bytes"``, ...).

    Args:
        inner: the backend that answers when no fault applies.

    Attributes:
        calls: method name -> calls made (faulty ones included).
    """

    METHODS = ("put_file", "put_bytes", "get_file", "get_bytes", "list", "delete", "exists")

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: collections.Counter[str] = collections.Counter()
        self._faults: dict[str, list[tuple[BackendError, str]]] = collections.defaultdict(list)
        self._gates: dict[str, threading.Event] = {}
        self._held: dict[str, threading.Semaphore] = collections.defaultdict(lambda: threading.Semaphore(0))
        self._corrupt: set[str] = set()
        self._corrupt_where = ""
        self._lock = threading.Lock()

    def fail(self, method: str, times: int = 1, *, retryable: bool = True, message: str = "",
             where: str = "") -> None:
        """Make the next ``times`` calls of ``method`` raise BackendError(``retryable``); with
        ``where``, only calls whose key contains it (``"/content/"``: chunks, ``"/manifests/"``)."""
        self._check(method)
        msg = message or ("503 SlowDown (injected)" if retryable else "403 AccessDenied (injected)")
        with self._lock:
            self._faults[method].extend((BackendError(msg, retryable=retryable), where) for _ in range(times))

    def clear_faults(self) -> None:
        """Drop every failure :meth:`fail` queued and not yet raised."""
        with self._lock:
            self._faults.clear()

    def hang(self, method: str) -> None:
        """Hold every call of ``method`` from now on until :meth:`release`."""
        self._check(method)
        with self._lock:
            self._gates.setdefault(method, threading.Event())

    def release(self, method: str) -> None:
        """Let the held calls of ``method`` (and later ones) proceed."""
        with self._lock:
            gate = self._gates.pop(method, None)
        if gate is not None:
            gate.set()

    def wait_held(self, method: str, timeout: float = 10.0) -> bool:
        """Until one call of ``method`` is being held (counted once per held call)."""
        return self._held[method].acquire(timeout=timeout)

    def corrupt_reads(self, *methods: str, where: str = "") -> None:
        """Flip one byte of every non-empty object that the read ``methods`` return from now on
        (default: ``get_bytes`` and ``get_file``; with ``where``, only objects whose key contains
        it); ``corrupt_reads("none")`` stops it."""
        if methods == ("none",):
            self._corrupt = set()
            return
        for m in methods:
            if m not in ("get_bytes", "get_file"):
                raise ValueError(f"FaultyBackend: {m!r} is not a read")
        self._corrupt = set(methods or ("get_bytes", "get_file"))
        self._corrupt_where = where

    def _check(self, method: str) -> None:
        if method not in self.METHODS:
            raise ValueError(f"FaultyBackend: unknown method {method!r}")

    def _enter(self, method: str, key: str = "") -> None:
        with self._lock:
            self.calls[method] += 1
            pending = self._faults[method]
            hit = next((i for i, (_, where) in enumerate(pending) if where in key), None)
            fault = pending.pop(hit)[0] if hit is not None else None
            gate = self._gates.get(method)
        if fault is not None:
            raise fault
        if gate is not None:
            self._held[method].release()
            gate.wait()

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        self._enter("put_file", key)
        self.inner.put_file(key, path)

    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        self._enter("put_file", key)  # a shard upload counts as put_file, from a path or a stream
        self.inner.put_stream(key, src, size)

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._enter("put_bytes", key)
        self.inner.put_bytes(key, data)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        self._enter("get_file", key)
        self.inner.get_file(key, path)
        if self._corrupts("get_file", key) and os.path.getsize(path):
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0xFF]))

    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        self._enter("get_bytes", key)
        data = self.inner.get_bytes(key, limit)
        if self._corrupts("get_bytes", key) and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        return data

    def list(self, prefix: str = "") -> list[str]:
        self._enter("list", prefix)
        return self.inner.list(prefix)

    def delete(self, keys: Sequence[str]) -> None:
        self._enter("delete", "\n".join(keys))
        self.inner.delete(keys)

    def exists(self, key: str) -> bool:
        self._enter("exists", key)
        return self.inner.exists(key)

    def _corrupts(self, method: str, key: str) -> bool:
        return method in self._corrupt and self._corrupt_where in key

    def close(self) -> None:
        self.release_all()
        self.inner.close()

    def release_all(self) -> None:
        """Release every held method."""
        for method in list(self._gates):
            self.release(method)
