"""What a :class:`tierckpt.Client` tells the user about its transfers: whether it sees the daemon's
local dir (else it streams over gRPC, saying why once), the daemon's fetch behind a restore, and
one INFO line per save and restore.

Progress callbacks of :meth:`tierckpt.Client.restore` take ``(bytes_done, bytes_total)`` (this
process reading the rank out of the daemon's local tier, as before) or, when they accept a third
argument, ``(bytes_done, bytes_total, tier)``: ``tier`` is ``"peer"`` or ``"persistent"`` while
the daemon fetches the rank from that tier into its local tier (polled with ``RestoreProgress``
every :data:`POLL_SECONDS`), then ``"local"`` while this process maps or receives it.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc

from ._catalog import TIER_NAMES
from .common.status import error_from_rpc
from .v1 import tierckpt_pb2 as pb

__all__ = ["FsView", "Reporter", "call_restore", "POLL_SECONDS", "log"]

log = logging.getLogger("tierckpt.client")

POLL_SECONDS = 0.2


class FsView:
    """Whether this process sees a daemon's local dir (its ``.fs-token`` holds the daemon's token)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], bool] = {}
        self._warned = False
        self._lock = threading.Lock()

    def sees(self, local_dir: str, token: str, *, warn: bool = True) -> bool:
        key = (local_dir, token)
        seen = self._seen.get(key)
        if seen is None:
            path = os.path.join(local_dir, ".fs-token")
            try:
                with open(path, "rb") as fh:
                    seen = fh.read().decode(errors="replace") == token
                why = f"{path} holds another daemon's token (the same path on another filesystem)"
            except OSError as e:
                seen, why = False, f"cannot read {path}: {e.strerror or e}"
            self._seen[key] = seen
            if not seen and warn:
                self.streaming(why)
        return seen

    def streaming(self, why: str) -> None:
        """Warn, once per client, that transfers go over gRPC instead of the shared local dir."""
        with self._lock:
            if self._warned:
                return
            self._warned = True
        log.warning("tierckpt: the daemon's local dir is not visible from this process (%s): saves and restores "
                    "stream their bytes over gRPC, several times slower than mapping the files. Run on the "
                    "daemon's node with its local_dir mounted at the same path (Kubernetes: the hostPath volume), "
                    "or pass Client(transfer='stream') to choose streaming without this warning.", why)


class Reporter:
    """A restore's progress callback split into the daemon's fetch and this process's copy."""

    def __init__(self, progress: Callable[..., None] | None) -> None:
        self.progress = progress
        self.with_tier = progress is not None and _takes_three(progress)

    def fetch(self, done: int, total: int, tier: str) -> None:
        if self.with_tier and self.progress is not None:
            self.progress(done, total, tier)

    def copy(self) -> Callable[[int, int], None] | None:
        if self.progress is None:
            return None
        if not self.with_tier:
            return self.progress
        progress = self.progress
        return lambda done, total: progress(done, total, "local")


def _takes_three(fn: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    n = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n >= 3


def call_restore(stub: Any, req: pb.RestoreRequest, address: str, report: Reporter) -> pb.RestoreResponse:
    """The Restore RPC (no deadline: a fetch may take long); while it is in flight and the
    callback wants it, the daemon's fetch is polled and reported. A daemon without
    ``RestoreProgress`` (older) is not asked again."""
    if not report.with_tier:  # nobody asked for the fetch's progress: the plain call
        try:
            return stub.Restore(req, timeout=None)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"Restore at {address}") from None
    call = stub.Restore.future(req, timeout=None)
    last: tuple[int, int, str] | None = None
    try:
        ask = pb.RestoreProgressRequest(job=req.job, rank=req.rank, has_step=req.has_step, step=req.step)
        while True:
            try:
                call.result(timeout=POLL_SECONDS)
                break
            except grpc.FutureTimeoutError:
                pass
            try:
                p = stub.RestoreProgress(ask, timeout=5.0)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                    break
                continue
            if p.fetching and p.bytes_total:
                last = (p.bytes_done, p.bytes_total, TIER_NAMES.get(p.tier, "persistent"))
                report.fetch(*last)
        resp = call.result()
    except grpc.RpcError as e:
        raise error_from_rpc(e, f"Restore at {address}") from None
    except BaseException:
        call.cancel()
        raise
    if resp.tier in (pb.TIER_PEER, pb.TIER_PERSISTENT) and (last is None or last[0] < last[1]):
        total = sum(s.size for s in resp.shards)  # the fetch finished between two polls (or before the first)
        report.fetch(total, total, TIER_NAMES[resp.tier])
    return resp
