"""Data-management verbs: ``policy``, ``rm``, ``verify``, ``persist`` (exit codes as the others;
``verify`` exits 1 when a copy does not match)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from .._admin import JobPolicy
from ..errors import InvalidArgumentError, NotFoundError
from ._commands import _check_job, write_json
from ._daemon import Session

__all__ = ["register", "EXAMPLES"]

EXAMPLES = {
    "policy": "examples:\n  tierckpt policy llama-70b\n"
              "  tierckpt policy llama-70b --keep-local 3 --persist-every 1000\n"
              "  tierckpt policy llama-70b --redundancy parity:4+1\n"
              "  tierckpt policy llama-70b --reset --json",
    "rm": "examples:\n  tierckpt rm llama-70b --step 1200\n  tierckpt rm llama-70b --step 1200 --tier persistent",
    "verify": "examples:\n  tierckpt verify llama-70b\n  tierckpt verify llama-70b --step 1200 --json",
    "persist": "examples:\n  tierckpt persist llama-70b --step 1200 --wait",
}


def _doc(p: JobPolicy) -> dict[str, Any]:
    return {"keep_local": p.keep_local, "keep_persistent": p.keep_persistent, "persist_every": p.persist_every,
            "redundancy": p.redundancy}


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def cmd_policy(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    fields = {k: getattr(args, k) for k in ("keep_local", "keep_persistent", "persist_every", "redundancy")
              if getattr(args, k) is not None}
    if fields.get("keep_local") == 0:
        raise InvalidArgumentError("--keep-local: must be >= 1")
    if fields or args.reset:
        over, eff = daemon.call(daemon.client.set_job_policy, args.job, reset=args.reset, **fields)
    else:
        over, eff = daemon.call(daemon.client.get_job_policy, args.job)
    if args.json:
        write_json({"job": args.job, "overrides": _doc(over), "effective": _doc(eff)}, out)
        return 0
    for k, v in _doc(eff).items():
        src = "job" if getattr(over, k) is not None else "daemon"
        out.write(f"{k:<16} {v}  ({src})\n")
    return 0


def cmd_rm(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    tiers = [args.tier] if args.tier else []
    r = daemon.call(daemon.client.delete_step, args.job, args.step, tiers)
    if not (r.local or r.peer or r.persistent or r.persistent_objects):
        where = f"the {args.tier} tier" if args.tier else "any reachable tier"
        missed = f" (not reached: {', '.join(r.unreachable)})" if r.unreachable else ""
        raise NotFoundError(f"{args.job} step {args.step} is not in {where}{missed}")
    if args.json:
        write_json({"job": args.job, "step": args.step, "local": r.local, "peer": r.peer,
                    "persistent": r.persistent, "persistent_objects": r.persistent_objects,
                    "unreachable": list(r.unreachable)}, out)
    else:
        out.write(f"removed {args.job} step {args.step}: local {r.local} ranks, peer {r.peer} copies, "
                  f"persistent {r.persistent} ranks ({r.persistent_objects} objects)\n")
        if r.unreachable:
            out.write(f"not reached (copies may remain): {', '.join(r.unreachable)}\n")
    return 0


def cmd_verify(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    r = daemon.call(daemon.client.verify_job, args.job, args.step)
    if not r.copies:
        what = args.job if args.step is None else f"{args.job} step {args.step}"
        missed = f" (not reached: {', '.join(r.unreachable)})" if r.unreachable else ""
        raise NotFoundError(f"{what}: no copy in any reachable tier{missed}")
    if args.json:
        write_json({"job": args.job, "mismatches": r.mismatches, "unreachable": list(r.unreachable),
                    "copies": [{"step": c.step, "rank": c.rank, "tier": c.tier, "node": c.node, "state": c.state,
                                "detail": c.detail} for c in r.copies]}, out)
    else:
        out.write(f"{'STEP':>10}  {'RANK':>6}  {'TIER':<10}  {'STATE':<8}  NODE\n")
        for c in r.copies:
            out.write(f"{c.step:>10}  {c.rank:>6}  {c.tier:<10}  {c.state:<8}  {c.node}"
                      + (f"  ({c.detail})" if c.detail else "") + "\n")
        out.write(f"{len(r.copies)} copies checked, {r.mismatches} mismatches\n")
        if r.unreachable:
            out.write(f"not checked: {', '.join(r.unreachable)}\n")
    return 1 if r.mismatches else 0


def cmd_persist(args: argparse.Namespace, daemon: Session, out: TextIO) -> int:
    _check_job(args.job)
    queued, done = daemon.call(daemon.client.persist_step, args.job, args.step, wait=args.wait, timeout=None)
    if args.json:
        write_json({"job": args.job, "step": args.step, "queued": queued, "persisted": done}, out)
    else:
        out.write(f"{args.job} step {args.step}: ranks {','.join(map(str, queued))} "
                  + ("in the persistent tier\n" if args.wait else "queued for the persistent tier\n"))
    return 0


def register(command: Callable[[str, str], argparse.ArgumentParser],
             add_connection: Callable[..., None]) -> None:
    """Add the verbs to the parser (``command`` makes a sub-parser)."""
    s = command("policy", "show or set a job's retention, persistence and redundancy policy on this node")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--keep-local", metavar="N", type=_nonneg, help="newest complete steps kept locally (>= 1)")
    s.add_argument("--keep-persistent", metavar="N", type=_nonneg,
                   help="newest complete steps kept in the persistent tier (0 = all)")
    s.add_argument("--persist-every", metavar="N", type=_nonneg,
                   help="every Nth step to the persistent tier (0 = none)")
    s.add_argument("--redundancy", metavar="SPEC",
                   help="peer redundancy of the job's ranks: replicas:R or parity:K+M (default: the daemon's)")
    s.add_argument("--reset", action="store_true", help="drop the job's overrides (the daemon's flags apply)")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    add_connection(s, sub=True)
    s.set_defaults(fn=cmd_policy)

    s = command("rm", "delete a step from every tier (or one): persistent manifests go before any data")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--step", metavar="N", type=_nonneg, required=True, help="step to delete")
    s.add_argument("--tier", metavar="TIER", choices=("local", "peer", "persistent"), help="local, peer or persistent; "
                   "only this tier (default: all)")
    s.add_argument("--json", action="store_true", help="print the counts as one JSON document")
    add_connection(s, sub=True)
    s.set_defaults(fn=cmd_rm)

    s = command("verify", "re-hash every copy of a job's steps in every tier (exit 1 on a mismatch)")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--step", metavar="N", type=_nonneg, default=None, help="only this step")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    add_connection(s, sub=True)
    s.set_defaults(fn=cmd_verify)

    s = command("persist", "drain a step to the persistent tier (the ranks this node owns)")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--step", metavar="N", type=_nonneg, required=True, help="step to persist")
    s.add_argument("--wait", action="store_true", help="return once it is in the persistent tier")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    add_connection(s, sub=True)
    s.set_defaults(fn=cmd_persist)
