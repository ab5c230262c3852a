"""Helpers shared by the security tests: run tierckptd for a refusal, snapshot a directory tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tierckptd.testing import _BIN_DIR


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under ``root`` with its mode, size and content: equal snapshots, nothing changed."""
    out: dict[str, tuple[int, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, p.read_bytes() if p.is_file() else b"")
    return out


def run_daemon(root: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Start tierckptd with a local dir and socket under ``root`` and wait for it to exit."""
    argv = [str(_BIN_DIR / "tierckptd"), "--node-id", "n0", "--local-dir", str(root / "data"),
            "--socket", str(root / "d.sock"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
