"""What a page of tmpfs costs its first writer on this machine, and what warming it ahead buys.

Each arm writes ``--gib`` GiB with ``pwrite`` (4 MiB pieces of random bytes) into one tmpfs file:

- overwrite: into a file whose pages were written before (the floor: a recycled file);
- fresh: into a new file;
- fallocated: into a new file whose pages ``fallocate(FALLOC_FL_KEEP_SIZE)`` allocated first
  (what warming did before ``warm_touch``);
- touched: into a new file whose pages ``MADV_POPULATE_WRITE`` touched first (tierckptd.local.warm.touch_pages).

Before each new file the bench frees the previous one and waits ``--settle`` seconds. Where the
kernel reports free memory to a hypervisor (virtio-balloon free page reporting, which
tierckptd.local.warm.free_pages_go_to_hypervisor detects), that wait lets the freed pages go back to
the host, so a new file is backed again by the host on its first write: the case of a daemon's
first saves and a peer's first copy. Elsewhere the arms differ only by the kernel's allocation.

Usage: .venv/bin/python bench/pages.py [--gib 1] [--settle 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tierckptd.local.warm import fallocate_keep_size, free_pages_go_to_hypervisor, touch_pages

PIECE = 4 << 20


def _write(path: Path, nbytes: int, buf: memoryview) -> float:
    fd = os.open(path, os.O_WRONLY)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, PIECE):
            os.pwrite(fd, buf[: min(PIECE, nbytes - off)], off)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _new(path: Path, nbytes: int, prepare: str) -> float:
    """Create ``path`` sized ``nbytes`` and prepare its pages; returns the seconds preparing took."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        t0 = time.perf_counter()
        for off in range(0, nbytes, 8 << 20) if prepare != "fresh" else ():
            n = min(8 << 20, nbytes - off)
            (fallocate_keep_size if prepare == "fallocated" else touch_pages)(fd, off, n)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between freeing a file and the next")
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // PIECE * PIECE
    buf = memoryview(os.urandom(PIECE))
    print(f"free page reporting to a hypervisor: {free_pages_go_to_hypervisor()}; {nbytes / 2**30:.2f} GiB, "
          f"settle {args.settle:.0f} s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="tck-pages-", dir=args.dir))
    rows: dict[str, tuple[float, float]] = {}
    try:
        f = root / "f"
        _new(f, nbytes, "fresh")
        _write(f, nbytes, buf)  # the pages exist now
        rows["overwrite (recycled file)"] = (0.0, _write(f, nbytes, buf))
        for arm in ("fresh", "fallocated", "touched"):
            f.unlink()
            time.sleep(args.settle)
            prep = _new(f, nbytes, arm)
            rows[f"{arm} file"] = (prep, _write(f, nbytes, buf))
    finally:
        for p in root.iterdir():
            p.unlink()
        root.rmdir()
    floor = rows["overwrite (recycled file)"][1]
    print("\n| arm | prepare s | write s | write / overwrite |\n|---|---|---|---|")
    for name, (prep, secs) in rows.items():
        print(f"| {name} | {prep:.3f} | {secs:.3f} | {secs / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
