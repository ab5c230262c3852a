"""The ``tierckpt`` command line: status, ls, latest, restore, plan.

Errors print one line on stderr and exit non-zero: 2 for bad input, 3 for an unreachable
daemon, 4 for a missing checkpoint, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

from .errors import InvalidArgumentError, NotFoundError, TierckptError, UnavailableError

__all__ = ["main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _client(args):
    from .client import Client

    return Client(args.address, timeout=args.timeout)


def cmd_status(args, out) -> int:
    with _client(args) as c:
        st = c.status()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        out.write(json.dumps(MessageToDict(st, always_print_fields_with_no_presence=True), indent=2) + "\n")
        return 0
    out.write(f"node        {st.node_id} (tierckptd {st.version}, up {st.uptime_seconds:.0f}s)\n")
    out.write(f"local tier  {st.local_dir}: {_fmt_bytes(st.used_bytes)} used of {_fmt_bytes(st.capacity_bytes)}"
              f" (staging {_fmt_bytes(st.staging_bytes)}, recycle {_fmt_bytes(st.recycle_bytes)})\n")
    out.write(f"peer tier   replicas={st.replicas}, {len(st.peers)} peers\n")
    for p in st.peers:
        state = "up" if p.up else f"DOWN ({p.last_error})" if p.last_error else "DOWN"
        out.write(f"  {p.node_id:<16} {p.address:<24} {state}\n")
    if st.persistent_url:
        out.write(f"persistent  {st.persistent_url}: backlog {st.drain_backlog_steps} ranks, "
                  f"{_fmt_bytes(st.drain_backlog_bytes)}, oldest {st.drain_oldest_age_seconds:.0f}s\n")
    else:
        out.write("persistent  not configured\n")
    for j in st.jobs:
        latest = j.latest if j.has_latest else "-"
        out.write(f"job         {j.job}: {j.steps} steps, latest complete {latest}, {_fmt_bytes(j.bytes)}\n")
    return 0


def cmd_ls(args, out) -> int:
    with _client(args) as c:
        infos = c.list(args.job)
    if args.json:
        out.write(json.dumps([{"step": i.step, "world_size": i.world_size, "complete": i.complete,
                               "tiers": list(i.tiers),
                               "ranks": [{"rank": r.rank, "tiers": list(r.tiers), "nodes": list(r.nodes),
                                          "bytes": r.nbytes} for r in i.ranks]} for i in infos], indent=2) + "\n")
        return 0
    if not infos:
        out.write(f"no checkpoints for job {args.job}\n")
        return 0
    out.write(f"{'STEP':>10}  {'RANKS':>9}  {'COMPLETE':<8}  {'TIERS':<24}  NODES\n")
    for i in infos:
        nodes = sorted({n for r in i.ranks for n in r.nodes})
        out.write(f"{i.step:>10}  {len(i.ranks):>4}/{i.world_size:<4}  {'yes' if i.complete else 'no':<8}  "
                  f"{','.join(i.tiers) or '-':<24}  {','.join(nodes) or '-'}\n")
    return 0


def cmd_latest(args, out) -> int:
    with _client(args) as c:
        step = c.latest(args.job)
    if step is None:
        raise NotFoundError(f"job {args.job!r} has no complete checkpoint")
    out.write(f"{step}\n")
    return 0


class _Progress:
    def __init__(self, stream) -> None:
        self.stream = stream
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / max(now - self.t0, 1e-9)
        self.stream.write(f"\r[{bar:<30}] {frac * 100:5.1f}% {_fmt_bytes(done)}/{_fmt_bytes(total)} "
                          f"{_fmt_bytes(rate)}/s")
        self.stream.flush()


def cmd_restore(args, out) -> int:
    if args.rank < 0:
        raise InvalidArgumentError("--rank: must be >= 0")
    if args.step is not None and args.step < 0:
        raise InvalidArgumentError("--step: must be >= 0")
    os.makedirs(args.out, exist_ok=True)
    progress = _Progress(sys.stderr) if not args.quiet else None
    with _client(args) as c:
        ck = c.restore(args.job, args.rank, args.step, progress=progress)
    if progress:
        sys.stderr.write("\n")
    for name, arr in ck.shards.items():
        tmp = os.path.join(args.out, f".{name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(memoryview(ck._buffers[name]))
        os.replace(tmp, os.path.join(args.out, name))
    meta = {"job": ck.job, "step": ck.step, "rank": ck.rank, "world_size": ck.world_size, "tier": ck.tier,
            "source_node": ck.source_node, "metadata": ck.metadata,
            "shards": {n: {"dtype": ck.dtypes[n], "shape": list(ck.shapes[n]), "bytes": int(a.nbytes)}
                       for n, a in ck.shards.items()}}
    with open(os.path.join(args.out, "checkpoint.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    out.write(f"restored {args.job} step {ck.step} rank {ck.rank} from the {ck.tier} tier into {args.out} "
              f"({len(ck.shards)} shards, {_fmt_bytes(sum(a.nbytes for a in ck.shards.values()))})\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt", description="Inspect and restore tierckpt checkpoints.")
    p.add_argument("--address", default=None,
                   help="daemon address (unix:///path or host:port; default $TIERCKPT_ADDRESS or "
                        "unix:///run/tierckpt/tierckptd.sock)")
    p.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="tiers, capacity, drain backlog and peers of the node's daemon")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    s = sub.add_parser("ls", help="steps of a job and where each rank is held")
    s.add_argument("job")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("latest", help="newest complete step of a job")
    s.add_argument("job")
    s.set_defaults(fn=cmd_latest)
    s = sub.add_parser("restore", help="restore one rank into a directory (one file per shard)")
    s.add_argument("job")
    s.add_argument("--rank", type=int, required=True)
    s.add_argument("--step", type=int, default=None, help="default: the latest complete step")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_restore)
    try:
        from .goodput import add_plan_arguments, run_plan
    except ImportError:  # pragma: no cover - goodput ships with the client
        pass
    else:
        s = sub.add_parser("plan", help="checkpoint intervals per tier that maximise goodput")
        add_plan_arguments(s)
        s.set_defaults(fn=lambda args, out: run_plan(args, out=out))
    for name in ("--address", "--timeout"):
        for sp in sub.choices.values():
            sp.add_argument(name, dest=name.lstrip("-"), default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            type=float if name == "--timeout" else str)
    return p


def main(argv: Sequence[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args, out)
    except InvalidArgumentError as e:
        print(f"tierckpt: error: {e}", file=sys.stderr)
        return 2
    except UnavailableError as e:
        print(f"tierckpt: error: cannot reach the daemon: {e}", file=sys.stderr)
        return 3
    except NotFoundError as e:
        print(f"tierckpt: error: {e}", file=sys.stderr)
        return 4
    except TierckptError as e:
        print(f"tierckpt: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"tierckpt: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
