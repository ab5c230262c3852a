"""``tierckpt doctor``: what stands between this process and a working daemon, first problem first.

Each check prints one ``ok`` line; the first that fails prints ``FAIL``, the problem and a
``hint:`` line, and the command exits non-zero (3 when the daemon cannot be reached or its
socket not opened, 1 for anything else). In order:

1. the socket (a ``unix:`` address): it exists, is a socket, and this user may open it;
2. the daemon answers (its node id, version and uptime);
3. this process's clock against the daemon's;
4. the fast path: this process sees the daemon's local dir (the daemon's ``.fs-token`` is
   readable here), so saves and restores map the files instead of streaming them over gRPC;
5. capacity: ``local_capacity`` against what the file system can still give and, on a RAM disk,
   against the memory available;
6. the persistent tier's health (the daemon's start-up probe and later errors);
7. the peers the daemon watches: up, and their clocks within ``--max-skew`` of its own.

Nothing here changes anything on the daemon or on disk.
"""

from __future__ import annotations

import argparse
import grp
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from ._commands import fmt_bytes
from ._daemon import DaemonUnreachable, Session, _unix_path

__all__ = ["register", "cmd_doctor", "EXAMPLES"]

EXAMPLES = {"doctor": "examples:\n  tierckpt doctor\n  tierckpt --address unix:///run/tierckpt/tierckptd.sock doctor "
                      "--max-skew 0.5"}

_MOUNTS = "/proc/self/mounts"
_MEMINFO = "/proc/meminfo"


class Problem(Exception):
    """A failed check: ``check`` names it, ``str()`` says what is wrong, ``hint`` what to do."""

    def __init__(self, check: str, message: str, hint: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.check, self.hint, self.exit_code = check, hint, exit_code


def register(command: Callable[[str, str], argparse.ArgumentParser], add_connection: Callable[..., None]) -> None:
    s = command("doctor", "check socket access, the fast path, capacity, every tier's health and clock skew")
    s.add_argument("--max-skew", metavar="SECONDS", type=float, default=1.0,
                   help="largest clock difference allowed against the daemon and its peers (default 1.0)")
    add_connection(s, sub=True)
    s.set_defaults(fn=cmd_doctor)


def cmd_doctor(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    try:
        for check, detail in checks(daemon, args.max_skew):
            out.write(f"ok    {check}: {detail}\n")
            out.flush()
    except Problem as p:
        out.write(f"FAIL  {p.check}: {p}\nhint: {p.hint}\n")
        return p.exit_code
    except DaemonUnreachable as e:
        out.write(f"FAIL  daemon: {e}\nhint: {e.hint}\n")
        return 3
    out.write("all checks passed\n")
    return 0


def checks(daemon: Session, max_skew: float) -> Iterator[tuple[str, str]]:
    """Runs the checks in order, yielding ``(check, detail)`` for each passed one; raises
    :class:`Problem` at the first failure (and :class:`DaemonUnreachable` if the daemon never answers)."""
    sock = _unix_path(daemon.address) if daemon.address.startswith("unix:") else None
    if sock is not None:
        yield "socket", _check_socket(sock, daemon.source)
    sent = time.time()
    st = daemon.call(daemon.client.status)
    skew = st.now_unix - (sent + time.time()) / 2 if st.now_unix else None
    yield "daemon", f"node {st.node_id}, tierckptd {st.version}, up {st.uptime_seconds:.0f} s, at {daemon.address}"
    if skew is None:
        yield "clock", "not reported by this daemon (an older version)"
    elif abs(skew) > max_skew:
        raise Problem("clock", f"the daemon's clock is {skew:+.2f} s from this machine's (more than {max_skew} s)",
                      "run a time service (chrony, systemd-timesyncd) on every node: steps, tombstones and "
                      "retention compare wall clocks")
    else:
        yield "clock", f"{skew:+.3f} s against the daemon"
    sees = _sees(st.local_dir, st.fs_token)
    if sees:
        yield "fast path", f"this process shares the daemon's local dir {st.local_dir}: saves and restores map it"
    elif sock is not None:
        raise Problem("fast path", f"this process cannot see the daemon's local dir {st.local_dir} (or it is another "
                      "file system at that path): saves and restores stream over gRPC, several times slower",
                      "run the trainer on the daemon's node with the local dir mounted at the same path (Kubernetes: "
                      "the hostPath volume in deploy/k8s/examples/trainer-job.yaml); in a container, mount it too")
    else:
        yield "fast path", f"not shared ({daemon.address} is a network address): saves and restores stream over gRPC"
    yield "capacity", _check_capacity(st, sees)
    if not st.persistent_url:
        yield "persistent tier", "not configured (--persistent): a lost cluster loses its checkpoints"
    elif st.persistent_error:
        raise Problem("persistent tier", f"{st.persistent_url} is degraded: {st.persistent_error}",
                      "check the daemon's credentials, the bucket and its write permission; saves keep going to the "
                      "local and peer tiers and drains wait until it works")
    else:
        yield "persistent tier", f"{st.persistent_url}: backlog {st.drain_backlog_steps} ranks, " \
                                 f"{fmt_bytes(st.drain_backlog_bytes)}"
    yield "peers", _check_peers(st, max_skew)


def _check_socket(path: str, source: str) -> str:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise Problem("socket", f"no socket at {path} (the address is from {source})",
                      "start tierckptd (systemctl status tierckptd) with --socket at this path, or point --address "
                      "or $TIERCKPT_ADDRESS at the daemon's socket", 3) from None
    except PermissionError:
        raise Problem("socket", f"{path}: a directory on the way may not be searched by this user",
                      "the socket's directory must be searchable by the socket group (mode 0750 or wider)", 3) from None
    if not stat.S_ISSOCK(info.st_mode):
        raise Problem("socket", f"{path} is not a socket", "point --address or $TIERCKPT_ADDRESS at the daemon's "
                      "--socket", 3)
    group = _group(info.st_gid)
    mode = stat.S_IMODE(info.st_mode)
    if not os.access(path, os.R_OK | os.W_OK):
        raise Problem("socket", f"{path} (mode {mode:04o}, group {group}) may not be opened by this user",
                      f"add the user to group {group} (usermod -aG {group} USER, then log in again), or run as a "
                      "member of the daemon's socket_group", 3)
    return f"{path} (mode {mode:04o}, group {group}): this user may connect"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _sees(local_dir: str, token: str) -> bool:
    if not local_dir or not token:
        return False
    try:
        with open(os.path.join(local_dir, ".fs-token"), "rb") as fh:
            return fh.read().decode(errors="replace") == token
    except OSError:
        return False


def _check_capacity(st: Any, sees: bool) -> str:
    used, cap = st.used_bytes, st.capacity_bytes
    said = f"{fmt_bytes(used)} used of {fmt_bytes(cap)} (local_capacity)"
    if not sees:
        return f"{said}; the file system is not visible here"
    vfs = os.statvfs(st.local_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if cap > used + free:
        raise Problem("capacity", f"local_capacity is {fmt_bytes(cap)} but {st.local_dir} has {fmt_bytes(free)} free "
                      f"beside the daemon's {fmt_bytes(used)}: saves will fail with a full disk before the daemon "
                      "evicts", "lower local_capacity (or leave it 0: the file system's free space) or grow the "
                      "file system")
    fstype = _fstype(st.local_dir)
    if fstype in ("tmpfs", "ramfs"):
        avail = _mem_available()
        if avail is not None and cap - used > avail:
            raise Problem("capacity", f"{st.local_dir} is a RAM disk ({fstype}) and may take {fmt_bytes(cap - used)} "
                          f"more, but only {fmt_bytes(avail)} of memory is available: the node would swap or the "
                          "OOM killer would pick a trainer", "lower local_capacity below the memory the trainers leave "
                          "free, or use an NVMe directory")
        return f"{said}; RAM disk with {fmt_bytes(avail or 0)} of memory available"
    return f"{said}; {fmt_bytes(free)} free on the file system ({fstype or 'unknown type'})"


def _fstype(path: str) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open(_MOUNTS) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def _mem_available() -> int | None:
    try:
        with open(_MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_peers(st: Any, max_skew: float) -> str:
    if not st.peers:
        return "none configured (--peers, --peers-dns): losing this node loses what is not in the persistent tier"
    down = [p for p in st.peers if not p.up]
    if down:
        names = ", ".join(f"{p.node_id} at {p.address} ({p.last_error or 'no answer'})" for p in down)
        raise Problem("peers", f"{len(down)} of {len(st.peers)} peers down: {names}",
                      "check those nodes' daemons (tierckpt --address HOST:PORT status) and the network and mTLS "
                      "certificates between the nodes; their copies are re-made elsewhere after owner_grace")
    skewed = [p for p in st.peers if p.clock_skew_known and abs(p.clock_skew_seconds) > max_skew]
    if skewed:
        names = ", ".join(f"{p.node_id} {p.clock_skew_seconds:+.2f} s" for p in skewed)
        raise Problem("peers", f"clock skew beyond {max_skew} s against the daemon: {names}",
                      "run a time service (chrony, systemd-timesyncd) on every node: tombstones and retention compare "
                      "wall clocks across nodes")
    worst = max((abs(p.clock_skew_seconds) for p in st.peers if p.clock_skew_known), default=None)
    clocks = f", clocks within {worst:.3f} s" if worst is not None else ""
    return f"{len(st.peers)} up{clocks}"
