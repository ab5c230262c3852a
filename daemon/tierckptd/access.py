"""What a client that reaches the Tierckpt service over TCP may do, by its certificate identity.

Trainers on the node use the Unix socket: its mode and group are the trust boundary there, and
grpcio exposes no peer credentials (SO_PEERCRED) of a Unix-socket caller, so those callers are
only bound by the node-wide ``max_open_saves``. Over TCP every caller presents a client
certificate (mTLS); with ``client_jobs`` configured, each certificate name may use only the jobs
its globs match, and with ``max_open_saves_per_client`` one identity may hold only that many
saves open. A save begun by one identity cannot be written, committed or aborted by another.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tierckpt.errors import CapacityError, PermissionDeniedError

from .tls import peer_identity

__all__ = ["ClientAccess", "parse_client_jobs", "JOB_GLOB_RE"]

JOB_GLOB_RE = re.compile(r"[A-Za-z0-9._*?\[\]!-]{1,128}")
_NAME_RE = re.compile(r"[A-Za-z0-9*][A-Za-z0-9._*-]{0,252}")


def parse_client_jobs(value: Any, key: str = "client_jobs") -> dict[str, tuple[str, ...]]:
    """``NAME=GLOB,NAME=GLOB,...`` (a name may repeat) or a TOML table ``{NAME = [GLOB, ...]}``
    into {certificate name: job globs}. Raises ValueError naming ``key``."""
    pairs: list[tuple[str, str]] = []
    if isinstance(value, Mapping):
        for name, globs in value.items():
            for g in [globs] if isinstance(globs, str) else list(globs):
                pairs.append((str(name), str(g)))
    elif isinstance(value, str):
        for item in (s.strip() for s in value.split(",")):
            if not item:
                continue
            name, eq, glob = item.partition("=")
            if not eq:
                raise ValueError(f"{key}: {item!r} is not NAME=JOB_GLOB")
            pairs.append((name.strip(), glob.strip()))
    else:
        raise ValueError(f"{key}: expected 'NAME=JOB_GLOB,...' or a table of lists")
    rules: dict[str, tuple[str, ...]] = {}
    for name, glob in pairs:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"{key}: {name!r} is not a certificate name (CN or DNS SAN)")
        if not JOB_GLOB_RE.fullmatch(glob):
            raise ValueError(f"{key}: {glob!r} (for {name}) is not a job glob such as llama-* or eval-?")
        rules[name] = (*rules.get(name, ()), glob)
    return rules


def format_client_jobs(rules: Mapping[str, tuple[str, ...]]) -> str:
    return ",".join(f"{n}={g}" for n, globs in rules.items() for g in globs)


class ClientAccess:
    """Job allow-list and open-save limit for the TCP-facing Tierckpt service.

    Args:
        rules: {certificate name: job globs}; empty = every CA-signed client may use every job.
        max_open_per_client: saves one identity may hold open at once (0 = only the node limit).
    """

    def __init__(self, rules: Mapping[str, tuple[str, ...]], max_open_per_client: int) -> None:
        self.rules = dict(rules)
        self.max_open = max_open_per_client
        self._open: dict[str, set[str]] = {}  # identity -> save ids it began (pruned as they end)
        self._beginning: dict[str, int] = {}  # identity -> BeginSaves in flight
        self._owner: dict[str, str] = {}  # save id -> the identity that began it

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.max_open > 0

    @staticmethod
    def identity(context: Any) -> str:
        """A stable name for the caller's certificate ("" without mTLS)."""
        return ",".join(sorted(peer_identity(context)))

    def _allowed_globs(self, context: Any) -> tuple[str, tuple[str, ...]]:
        names = peer_identity(context)
        shown = ", ".join(sorted(names)) or "none (no client certificate)"
        globs = tuple(g for n in sorted(names) for pat, gs in self.rules.items()
                      if fnmatch.fnmatchcase(n, pat) for g in gs)
        if not globs:
            raise PermissionDeniedError(f"client certificate names {shown} are not in client_jobs on this node")
        return shown, globs

    def check_job(self, context: Any, job: str) -> None:
        """PermissionDeniedError unless the caller's certificate may use ``job``."""
        if not self.rules:
            return
        shown, globs = self._allowed_globs(context)
        if not any(fnmatch.fnmatchcase(job, g) for g in globs):
            raise PermissionDeniedError(f"job: {job!r} is not allowed for client {shown} (client_jobs: "
                                        f"{', '.join(globs)})")

    def visible(self, context: Any, job: str) -> bool:
        """Whether a listing shown to the caller includes ``job``."""
        try:
            self.check_job(context, job)
        except PermissionDeniedError:
            return False
        return True

    @contextmanager
    def beginning(self, context: Any, is_open: Callable[[str], bool]) -> Iterator[list[str]]:
        """Around one BeginSave: refuse when the caller holds ``max_open`` saves (``is_open(id)``
        says which of its saves are still open); the handler appends the new save id to the
        yielded list, and the save is the caller's from then on."""
        who = self.identity(context)
        mine = self._open.setdefault(who, set())
        for ended in [s for s in mine if not is_open(s)]:
            mine.discard(ended)
            self._owner.pop(ended, None)
        held = len(mine) + self._beginning.get(who, 0)
        if 0 < self.max_open <= held:
            raise CapacityError(f"saves: client {who or 'without a certificate'} holds {held} open saves on this "
                                f"node (max_open_saves_per_client {self.max_open}); commit or abort some first")
        self._beginning[who] = self._beginning.get(who, 0) + 1
        out: list[str] = []
        try:
            yield out
        finally:
            self._beginning[who] -= 1
            mine.update(out)
            self._owner.update(dict.fromkeys(out, who))

    def check_save(self, context: Any, save_id: str) -> None:
        """A save begun over TCP may be written, committed or aborted only by the identity that
        began it (an id nobody began here goes on to the usual INVALID_ARGUMENT)."""
        owner = self._owner.get(save_id)
        if owner is not None and owner != self.identity(context):
            raise PermissionDeniedError("save_id: this save was begun by another client")
