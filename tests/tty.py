"""Run a command with its stderr on a pseudo-terminal (where the CLI draws progress) and collect
what it drew."""

from __future__ import annotations

import os
import pty
import subprocess
from collections.abc import Mapping, Sequence


def run_on_tty(argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = 60) -> tuple[subprocess.CompletedProcess, bytes]:
    """``(the finished process, stdout captured), everything written to its terminal stderr``."""
    master, slave = pty.openpty()
    try:
        p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=slave, env=env, timeout=timeout)
        os.close(slave)
        slave = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO once the other side is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    return p, drawn
