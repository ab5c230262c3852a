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
from dataclasses import dataclass
from typing import Any

from tierckpt.common.names import check_owner
from tierckpt.errors import CapacityError, InvalidArgumentError, PermissionDeniedError

from .tls import peer_identity

__all__ = ["ClientAccess", "parse_client_jobs", "JOB_GLOB_RE", "tcp_owner", "TenantSocket", "parse_tenant_sockets"]

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


@dataclass(frozen=True)
class TenantSocket:
    """One tenant's Unix socket (``tenant_sockets``): callers on it act as ``name``."""

    name: str
    path: str
    group: str
    mode: int = 0o660


def parse_tenant_sockets(value: Any, key: str = "tenant_sockets") -> list[TenantSocket]:
    """``NAME=PATH:GROUP[:MODE],...`` or a TOML table ``{NAME = {path, group, mode}}``. Raises
    ValueError naming ``key``: a bad name, a relative or repeated path, a missing group, a mode
    outside 0..0777."""
    items: list[tuple[str, Any, Any, Any]] = []
    if isinstance(value, Mapping):
        for name, spec in value.items():
            if not isinstance(spec, Mapping):
                raise ValueError(f"{key}.{name}: expected a table with path, group and mode")
            items.append((str(name), spec.get("path", ""), spec.get("group", ""), spec.get("mode", "0660")))
    elif isinstance(value, str):
        for item in (s.strip() for s in value.split(",")):
            if not item:
                continue
            name, eq, rest = item.partition("=")
            parts = rest.split(":")
            if not eq or len(parts) not in (2, 3):
                raise ValueError(f"{key}: {item!r} is not NAME=PATH:GROUP[:MODE]")
            items.append((name.strip(), parts[0], parts[1], parts[2] if len(parts) == 3 else "0660"))
    else:
        raise ValueError(f"{key}: expected 'NAME=PATH:GROUP[:MODE],...' or a table")
    out: list[TenantSocket] = []
    for name, path, group, mode in items:
        try:
            check_owner(name, f"{key} name")
        except InvalidArgumentError as e:
            raise ValueError(str(e)) from None
        if not name:
            raise ValueError(f"{key}: a tenant needs a name")
        if not isinstance(path, str) or not path.startswith("/") or any(t.path == path for t in out):
            raise ValueError(f"{key}.{name}: path {path!r} must be an absolute path of its own")
        if not isinstance(group, str | int) or not str(group):
            raise ValueError(f"{key}.{name}: a group is required (the tenant's trainers' group)")
        try:
            bits = int(mode, 8) if isinstance(mode, str) else int(mode)
        except ValueError:
            raise ValueError(f"{key}.{name}: mode {mode!r} is not octal such as 0660") from None
        if not 0 <= bits <= 0o777:
            raise ValueError(f"{key}.{name}: mode {mode!r} is out of range 0..0777")
        out.append(TenantSocket(name, path, str(group), bits))
    return out


def format_tenant_sockets(tenants: list[TenantSocket]) -> str:
    return ",".join(f"{t.name}={t.path}:{t.group}:{t.mode:04o}" for t in tenants)


def tcp_owner(context: Any) -> str:
    """The job owner a TCP caller acts as: its client certificate's name (role URI, else CN); ""
    (the default tenant) without mTLS (``insecure_listen``: the network is the boundary).

    Raises:
        PermissionDeniedError: the certificate's name cannot be an owner name.
    """
    from .tls import peer_role

    role = peer_role(context)
    if role is None:
        return ""
    name = role.name or min(role.names, default="")
    if not name:
        raise PermissionDeniedError("client certificate: it names no identity (no role URI, CN or DNS SAN)")
    try:
        return check_owner(name, "client certificate")
    except InvalidArgumentError as e:
        raise PermissionDeniedError(str(e)) from None


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
