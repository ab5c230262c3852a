"""Run real tierckptd daemons as subprocesses: for integration tests, the demo, benchmarks and
users' own tests of code that checkpoints through tierckpt.

Each daemon gets its own local dir on tmpfs (/dev/shm), a short Unix socket path and a TCP port.
Ports are either chosen by the daemon (port 0, read back from its READY line) or reserved up
front with :func:`free_port` when peers must know them before start-up.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .logs import parse_ready_line

__all__ = ["Daemon", "free_port", "scratch_dir"]

_BIN_DIR = Path(sys.executable).parent


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port outside the kernel's ephemeral range, not handed out before by this
    process: a port reserved for a daemon started later cannot be taken meanwhile by a socket that
    binds port 0 (the daemons' bulk channels, client connections)."""
    lo, hi = _ephemeral_range()
    for _ in range(10000):
        p = random.randrange(10000, 65536)
        if lo <= p <= hi or p in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
        _HANDED_OUT.add(p)
        return p
    raise RuntimeError("no free port outside the ephemeral range")


def scratch_dir(prefix: str = "tck-") -> Path:
    """A fresh directory on tmpfs when available (short path: Unix sockets allow ~107 bytes)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def _oom_victim_first(pid: int) -> None:
    """If the machine runs out of memory, the kernel kills a test's daemon (its test fails and
    says so) before the test runner, whose death would end the whole run with one "Killed"
    line. Raising a process's ``oom_score_adj`` needs no privilege."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("500")


class Daemon:
    """One tierckptd process. ``args`` are extra flags; the dir holds data/ and d.sock."""

    def __init__(self, root: Path, node_id: str = "node0", *, port: int = 0, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, log_name: str | None = None) -> None:
        self.root = Path(root)
        self.node_id = node_id
        self.port = port
        self.args = tuple(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.log_path = self.root / (log_name or f"{node_id}.log")

    @property
    def local_dir(self) -> Path:
        return self.root / f"{self.node_id}-data"

    @property
    def socket(self) -> Path:
        return self.root / f"{self.node_id}.sock"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.info['tcp_port']}"

    def command(self) -> list[str]:
        return [str(_BIN_DIR / "tierckptd"), "--node-id", self.node_id, "--local-dir", str(self.local_dir),
                "--socket", str(self.socket), "--listen", f"127.0.0.1:{self.port}", *self._insecure(), *self.args]

    def _insecure(self) -> tuple[str, ...]:
        """Plain TCP on loopback needs the explicit flag: added unless the args set up mTLS or decide it."""
        if any(a in self.args for a in ("--tls-cert", "--insecure-listen", "--no-insecure-listen")):
            return ()
        return ("--insecure-listen",)

    def start(self, timeout: float = 30.0) -> Daemon:
        self.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **(self.env or {}))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        _oom_victim_first(self.proc.pid)
        line: list[bytes] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            line.append(self.proc.stdout.readline())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        info = parse_ready_line(line[0].decode(errors="replace").strip()) if line else None
        if info is None:
            self.kill()
            raise RuntimeError(f"tierckptd {self.node_id} did not start:\n{self.log_tail()}")
        self.info = info
        if not self.port:
            self.port = self.info["tcp_port"]
        return self

    def log_text(self) -> str:
        """The whole log of this daemon (every start of it: the file is appended to). Tests that
        look for a line read this, not a tail, which other lines (a dead peer's reconnects) can
        push it out of."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of :meth:`log_text` (for failure messages)."""
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing is cleaned up."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def restart(self) -> Daemon:
        self.kill()
        return self.start()

    def wipe(self) -> None:
        """Lose the node's local tier (a replaced machine)."""
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def client(self, **kw):
        import tierckpt

        return tierckpt.Client(self.address, **kw)
from .fakes import FaultyBackend, MemoryBackend  # noqa: E402,F401  (in-process test doubles)
