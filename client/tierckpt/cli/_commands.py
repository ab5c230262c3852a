"""The daemon sub-commands: status, ls, latest, restore.

Each takes the parsed arguments, a :class:`~tierckpt.cli._daemon.Session` and the output stream,
writes text or (``--json``) one JSON document, and returns 0; failures are raised. JSON keys are
snake_case and integers are numbers (the README has the schema of each command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, TextIO

from ..common.names import check_job
from ..errors import InvalidArgumentError, NotFoundError
from ._daemon import Session

__all__ = ["cmd_status", "cmd_ls", "cmd_latest", "cmd_restore", "fmt_bytes", "write_json"]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def write_json(doc: Any, out: TextIO) -> None:
    json.dump(doc, out, indent=2)
    out.write("\n")


def _check_job(job: str) -> None:
    check_job(job, "JOB")  # before the daemon is asked: bad input is exit 2 even with no daemon


# ---------------------------------------------------------------------------------- status

def status_doc(st: Any) -> dict[str, Any]:
    """The ``status --json`` document from a ``StatusResponse``."""
    return {
        "node_id": st.node_id,
        "version": st.version,
        "uptime_seconds": st.uptime_seconds,
        "local_tier": {"dir": st.local_dir, "capacity_bytes": st.capacity_bytes, "used_bytes": st.used_bytes,
                       "staging_bytes": st.staging_bytes, "recycle_bytes": st.recycle_bytes,
                       "reserve_bytes": st.reserve_bytes, "reserve_target_bytes": st.reserve_target_bytes,
                       "reserve_ready_bytes": st.reserve_ready_bytes, "reserve_taken_bytes": st.reserve_taken_bytes},
        "peer_tier": {"configured": len(st.peers) > 0, "replicas": st.replicas,
                      "peers": [{"node_id": p.node_id, "address": p.address, "up": p.up,
                                 # absent values are null (never seen: not 1970; no error: not "")
                                 "last_seen_unix": p.last_seen_unix or None, "last_error": p.last_error or None}
                                for p in st.peers]},
        "persistent_tier": {"configured": bool(st.persistent_url), "url": st.persistent_url,
                            "backlog_ranks": st.drain_backlog_steps, "backlog_bytes": st.drain_backlog_bytes,
                            "oldest_age_seconds": st.drain_oldest_age_seconds,
                            "error": st.persistent_error or None},
        "jobs": [{"job": j.job, "steps": j.steps, "latest": j.latest if j.has_latest else None, "bytes": j.bytes}
                 for j in st.jobs],
    }


def cmd_status(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    st = daemon.call(daemon.client.status)
    if args.json:
        write_json(status_doc(st), out)
        return 0
    w = out.write
    w(f"node: {st.node_id} (tierckptd {st.version}, up {st.uptime_seconds:.0f} s) at {daemon.address}\n")
    w(f"local tier: {st.local_dir}: {fmt_bytes(st.used_bytes)} used of {fmt_bytes(st.capacity_bytes)}"
      f" (staging {fmt_bytes(st.staging_bytes)}, recycle {fmt_bytes(st.recycle_bytes)}"
      + (f", reserve {fmt_bytes(st.reserve_bytes)} of {fmt_bytes(st.reserve_target_bytes)}"
         if st.reserve_target_bytes else "") + ")\n")
    if not st.peers:
        w("peer tier: not configured (no --peers or --peers-dns)\n")
    elif st.replicas == 0:
        w(f"peer tier: replication off (replicas 0), {len(st.peers)} peers\n")
    else:
        up = sum(1 for p in st.peers if p.up)
        w(f"peer tier: {st.replicas} {'copy' if st.replicas == 1 else 'copies'} of every rank; "
          f"{up} of {len(st.peers)} peers up\n")
    for p in st.peers:
        state = "up" if p.up else f"DOWN ({p.last_error})" if p.last_error else "DOWN"
        w(f"  {p.node_id:<16} {p.address:<24} {state}\n")
    if st.persistent_url and st.persistent_error:
        w(f"persistent tier: {st.persistent_url}: DEGRADED: {st.persistent_error}\n")
    if st.persistent_url:
        w(f"persistent tier: {st.persistent_url}: backlog {st.drain_backlog_steps} ranks, "
          f"{fmt_bytes(st.drain_backlog_bytes)}, oldest {st.drain_oldest_age_seconds:.0f} s\n")
    else:
        w("persistent tier: not configured (no --persistent)\n")
    if not st.jobs:
        w("jobs: none\n")
    for j in st.jobs:
        latest = j.latest if j.has_latest else "none"
        w(f"job {j.job}: {j.steps} steps, latest complete {latest}, {fmt_bytes(j.bytes)}\n")
    return 0


# -------------------------------------------------------------------------------------- ls

def cmd_ls(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    infos = daemon.call(daemon.client.list, args.job)
    if not infos:
        raise NotFoundError(f"job {args.job!r} has no checkpoint in any reachable tier")
    if args.json:
        write_json({"job": args.job, "checkpoints": [
            {"step": i.step, "world_size": i.world_size, "complete": i.complete, "complete_in": list(i.tiers),
             "created_unix": i.created, "bytes": sum(r.nbytes for r in i.ranks),
             "ranks": [{"rank": r.rank, "tiers": list(r.tiers), "nodes": list(r.nodes), "bytes": r.nbytes}
                       for r in i.ranks]} for i in infos]}, out)
        return 0
    w = out.write
    w(f"{'STEP':>10}  {'RANKS':>9}  {'COMPLETE':<8}  {'COMPLETE IN':<22}  {'BYTES':>10}  NODES\n")
    for i in infos:
        w(f"{i.step:>10}  {len(i.ranks):>4}/{i.world_size:<4}  {'yes' if i.complete else 'no':<8}  "
          f"{','.join(i.tiers) or '-':<22}  {fmt_bytes(sum(r.nbytes for r in i.ranks)):>10}  "
          f"{_holders(i.ranks)}\n")
        if args.ranks:
            held = {r.rank: r for r in i.ranks}
            for rank in range(i.world_size):
                r = held.get(rank)
                if r is None:
                    w(f"{'':>10}  {'rank ' + str(rank):>9}  {'missing':<8}  {'-':<22}  {'-':>10}  -\n")
                else:
                    w(f"{'':>10}  {'rank ' + str(rank):>9}  {'':<8}  {','.join(r.tiers) or '-':<22}  "
                      f"{fmt_bytes(r.nbytes):>10}  {_holders([r])}\n")
    w("COMPLETE IN: tiers that hold every rank of the step" +
      ("; rank rows: the tiers and nodes holding that rank\n" if args.ranks else " (--ranks: per rank)\n"))
    return 0


def _holders(ranks: Any) -> str:
    """The NODES column: the nodes holding the ranks, and ``object store`` for copies held
    there (the persistent tier is no node)."""
    names = sorted({n for r in ranks for n in r.nodes})
    if any("persistent" in r.tiers for r in ranks):
        names.append("object store")
    return ",".join(names) or "-"


# ---------------------------------------------------------------------------------- latest

def cmd_latest(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    step = daemon.call(daemon.client.latest, args.job)
    if step is None:
        raise NotFoundError(f"job {args.job!r} has no complete checkpoint in any tier")
    if args.json:
        write_json({"job": args.job, "step": step}, out)
    else:
        out.write(f"{step}\n")
    return 0


# --------------------------------------------------------------------------------- restore

class _Progress:
    """A progress bar on a terminal: redrawn at most 10 times a second."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.t0 = time.monotonic()
        self.last = 0.0
        self.drawn = False
        self.tier: str | None = None

    def __call__(self, done: int, total: int, tier: str = "local") -> None:
        """``tier``: "peer"/"persistent" while the daemon fetches the rank, "local" for this process's copy."""
        now = time.monotonic()
        if tier != self.tier:  # a new stage: its own line and rate
            if self.drawn:
                self.stream.write("\n")
            self.t0, self.last, self.tier = now, 0.0, tier
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / max(now - self.t0, 1e-9)
        what = "reading" if tier == "local" else f"daemon fetching from the {tier} tier"
        self.stream.write(f"\r[{bar:<30}] {frac * 100:5.1f}% {fmt_bytes(done)}/{fmt_bytes(total)} "
                          f"{fmt_bytes(rate)}/s {what}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _check_out(path: str, force: bool) -> bool:
    """Refuses an --out that cannot become the restored directory, before anything is asked or
    created. Returns whether it is an existing, empty directory (written in place)."""
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isdir(path):
            raise InvalidArgumentError(f"--out: {path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"--out: {path} is not writable")
        if not os.listdir(path):
            return True
        if not force:
            raise InvalidArgumentError(f"--out: {path} is not empty (--force replaces it whole)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "replace" if os.path.lexists(path) else "create"
        raise InvalidArgumentError(f"--out: cannot {what} {path}: {parent} is not a writable directory")
    return False


def _write_out(ck: Any, out: str, in_place: bool) -> tuple[dict[str, str], dict[str, Any]]:
    """The shards and ``checkpoint.json`` under ``out``: written in place into an empty directory,
    else into a sibling temporary directory that then becomes ``out`` (an existing one, with
    --force, is swapped out and removed): ``out`` never holds a mix of two checkpoints."""
    final = os.path.abspath(out)
    if in_place:
        work = final
    else:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        work = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", suffix=".tmp", dir=os.path.dirname(final))
    try:
        for name in ck.shards:
            _write_file(os.path.join(work, name), memoryview(ck._buffers[name]), os.path.join(out, name))
        meta = {"job": ck.job, "step": ck.step, "rank": ck.rank, "world_size": ck.world_size, "tier": ck.tier,
                "source_node": ck.source_node, "metadata": ck.metadata,
                "shards": {n: {"dtype": ck.dtypes[n], "shape": list(ck.shapes[n]), "bytes": int(a.nbytes)}
                           for n, a in ck.shards.items()}}
        _write_file(os.path.join(work, "checkpoint.json"), json.dumps(meta, indent=2).encode(),
                    os.path.join(out, "checkpoint.json"))
        if not in_place:
            _swap_in(work, final)
    except BaseException:
        if not in_place:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the directory was empty: empty it again
            for name in os.listdir(work):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(work, name))
        raise
    return {n: os.path.join(out, n) for n in ck.shards}, meta


def _write_file(path: str, data: Any, shown: str) -> None:
    """One file under a temporary name, then renamed (errors name ``shown``, the final path)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, shown) from e


def _swap_in(work: str, final: str) -> None:
    """``work`` becomes ``final``; a directory already there is moved aside first, then removed."""
    if not os.path.lexists(final):
        os.rename(work, final)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", suffix=".old", dir=os.path.dirname(final))
    os.rename(final, os.path.join(old, "out"))
    try:
        os.rename(work, final)
    except OSError:
        os.rename(os.path.join(old, "out"), final)  # put the previous directory back
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


def cmd_restore(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    if args.rank < 0:
        raise InvalidArgumentError(f"--rank: must be >= 0, got {args.rank}")
    if args.step is not None and args.step < 0:
        raise InvalidArgumentError(f"--step: must be >= 0, got {args.step}")
    in_place = _check_out(args.out, args.force)
    c = daemon.client
    # The restore RPC itself has no deadline (a fetch from the object store may take long), so a
    # short control call first proves the daemon answers within --timeout.
    step = args.step
    if step is None:
        step = daemon.call(c.latest, args.job)
        if step is None:
            raise NotFoundError(f"job {args.job!r} has no complete checkpoint in any tier")
    else:
        daemon.call(c.status)
    progress = _Progress(sys.stderr) if not args.quiet and sys.stderr.isatty() else None
    try:
        ck = daemon.call(c.restore, args.job, args.rank, step, progress=progress)
    finally:
        if progress:
            progress.finish()
    # Only now, with the checkpoint in hand, is anything created under --out.
    files, meta = _write_out(ck, args.out, in_place)
    total = sum(int(a.nbytes) for a in ck.shards.values())
    if args.json:
        doc = dict(meta, out=os.path.abspath(args.out), bytes=total)
        for n, f in files.items():
            doc["shards"][n]["file"] = os.path.abspath(f)
        write_json(doc, out)
    else:
        out.write(f"restored {ck.job} step {ck.step} rank {ck.rank} from the {ck.tier} tier into {args.out} "
                  f"({len(ck.shards)} shards, {fmt_bytes(total)})\n")
    return 0
