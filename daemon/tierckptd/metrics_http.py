"""/metrics over HTTP with bounded resources: a fixed number of threads and connections, and a
deadline per connection, whoever connects to the metrics port.

prometheus-client's own server starts a thread per connection and waits forever for a request:
120 idle connections are 120 threads. :class:`BoundedMetricsServer` keeps wsgiref's request
handling (the standard library parses HTTP; the app is prometheus-client's ``make_wsgi_app``) and
changes only how connections are scheduled:

- one dispatcher thread accepts connections and waits in a selector until a connection has
  bytes to read; an idle connection costs a descriptor, never a thread;
- a readable connection is answered by a pool of ``KNOBS.metrics_http_workers`` threads (one
  request per connection, as wsgiref serves it);
- at most ``KNOBS.metrics_http_max_connections`` connections are held: one more closes the oldest
  idle connection, or is closed at once when every held one is being answered;
- every connection has ``KNOBS.metrics_http_timeout`` seconds from its accept to the end of its
  answer: an idle one is closed then, one whose request dribbles in is shut down under its
  worker (each socket read also times out after that long).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .knobs import KNOBS

__all__ = ["BoundedMetricsServer"]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log (scrapes every few seconds)."""


class BoundedMetricsServer(WSGIServer):
    """Serve a WSGI app (``/metrics``) on ``host:port`` with bounded threads and connections (see
    the module docstring). :meth:`start` runs the dispatcher thread; :meth:`shutdown` stops it.

    Raises:
        OSError: the address cannot be bound.
    """

    request_queue_size = 64  # listen backlog: a burst of connections waits for the dispatcher, not refused

    def __init__(self, host: str, port: int, app: Any) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        super().__init__((str(sockaddr[0]), port), _QuietHandler)
        self.set_app(app)
        self.workers = max(1, KNOBS.metrics_http_workers)
        self.max_connections = max(1, KNOBS.metrics_http_max_connections)
        self.deadline = KNOBS.metrics_http_timeout or 10.0
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="metrics-http")
        self._sel = selectors.DefaultSelector()
        self._idle: dict[socket.socket, tuple[float, Any]] = {}  # accepted, nothing read yet: (deadline, addr)
        self._busy: dict[socket.socket, float] = {}  # handed to a worker: deadline
        self._lock = threading.Lock()  # guards _busy (workers remove themselves)
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        self.socket.setblocking(False)
        self._sel.register(self.socket, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._dispatch, name="metrics-http", daemon=True)
        self._thread.start()
        return self._thread

    def shutdown(self) -> None:
        """Stop accepting, close every held connection and wait for the dispatcher (idempotent)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def server_close(self) -> None:
        super().server_close()
        for s in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):  # unset: the bind failed
            if s is not None:
                s.close()

    # -- the dispatcher thread

    def _dispatch(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._sel.select(timeout=min(0.5, self.deadline)):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        self._hand_over(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            for conn in list(self._idle):
                self._drop(conn)
            with self._lock:
                busy = list(self._busy)
            for conn in busy:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._sel.close()

    def _accept(self) -> None:
        try:
            conn, addr = self.socket.accept()
        except OSError:  # gone before we took it, or out of descriptors: the next select tries again
            return
        with self._lock:
            held = len(self._idle) + len(self._busy)
        if held >= self.max_connections:
            if not self._idle:
                conn.close()  # every held connection is being answered: refuse this one
                return
            self._drop(min(self._idle, key=lambda c: self._idle[c][0]))  # the oldest idle one goes
        self._idle[conn] = (time.monotonic() + self.deadline, addr)
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _hand_over(self, conn: socket.socket) -> None:
        deadline, addr = self._idle.pop(conn)
        self._sel.unregister(conn)
        with self._lock:
            self._busy[conn] = deadline
        self._pool.submit(self._answer, conn, addr)

    def _answer(self, conn: socket.socket, addr: Any) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self.deadline)
            self.finish_request(conn, addr)  # one request, parsed and answered by wsgiref
        except Exception:  # a client that hung up or timed out: nothing to report
            pass
        finally:
            with self._lock:
                self._busy.pop(conn, None)
            self.shutdown_request(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (d, _) in self._idle.items() if d <= now]:
            self._drop(conn)
        with self._lock:
            late = [c for c, d in self._busy.items() if d <= now]
        for conn in late:  # its worker is blocked reading a dribbled request: end that read
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _drop(self, conn: socket.socket) -> None:
        self._idle.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        conn.close()
