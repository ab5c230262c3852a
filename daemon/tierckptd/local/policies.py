"""Per-job policies: ``keep_local``, ``keep_persistent``, ``persist_every``, ``redundancy`` overridden per job.

A job's overrides are set by a client (SetJobPolicy, or a CommitSave carrying a policy) and kept
in ``<local_dir>/policies/<job>.json`` (written with the local dir's safe primitives: temporary
name, then rename; never through a symlink). The start-up scan of the local tier only looks at
``jobs/``, ``staging/`` and ``recycle/``, so this directory is neither reclaimed nor quarantined.
An unset field falls back to the daemon's flag of the same name.

Readers: local retention (:meth:`JobPolicies.keep_local`, through the store), drain selection
(:meth:`JobPolicies.persist_every`), persistent retention (:meth:`JobPolicies.keep_persistent`), the
peer tier (:meth:`JobPolicies.redundancy`: replicas or parity for the ranks this node owns; the
tier installs :attr:`JobPolicies.check_redundancy` for the bounds that depend on the cluster).

Thread safety: every method may be called from any thread (one lock guards the table).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from tierckpt.common.names import JOB_RE
from tierckpt.errors import InvalidArgumentError

from ..config import ConfigError, parse_job_redundancy
from .localfs import LocalDir, UnsafeFileError

__all__ = ["JobPolicy", "JobPolicies", "POLICY_DIR"]

log = logging.getLogger(__name__)

POLICY_DIR = "policies"
_MAX_BYTES = 4096
_MINIMUM = {"keep_local": 1, "keep_persistent": 0, "persist_every": 0}
_FIELDS = (*_MINIMUM, "redundancy")
_MAXIMUM = 1 << 31


@dataclass(frozen=True)
class JobPolicy:
    """A job's policy; ``None`` means "the daemon's flag"."""

    keep_local: int | None = None
    keep_persistent: int | None = None
    persist_every: int | None = None
    redundancy: str | None = None
    """"replicas:R" or "parity:K+M" (:func:`tierckptd.config.parse_job_redundancy`)."""

    def checked(self) -> JobPolicy:
        """Itself, or InvalidArgumentError naming the first bad field."""
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "redundancy":
                check_redundancy_text(v)
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not _MINIMUM[f.name] <= v < _MAXIMUM:
                raise InvalidArgumentError(f"policy.{f.name}: {v!r} must be an integer >= {_MINIMUM[f.name]}")
        return self

    def merged(self, over: JobPolicy) -> JobPolicy:
        """This policy with the fields set in ``over`` replacing its own."""
        return replace(self, **{k: v for k, v in asdict(over).items() if v is not None})

    def is_empty(self) -> bool:
        return all(v is None for v in asdict(self).values())


def check_redundancy_text(v: Any) -> tuple[int, tuple[int, int] | None]:
    """(R, None) or (0, (K, M)) of a policy's ``redundancy``; InvalidArgumentError naming the field."""
    if not isinstance(v, str) or len(v) > 32:
        raise InvalidArgumentError(f"policy.redundancy: {v!r} must be replicas:R or parity:K+M")
    try:
        return parse_job_redundancy(v)
    except ConfigError as e:
        raise InvalidArgumentError(f"policy.{e}") from None


class JobPolicies:
    """The per-job overrides of one node, and the daemon's defaults.

    Args:
        defaults: the daemon's flags (every field set).
        fsync: flush policy files (durable media).
    """

    def __init__(self, defaults: JobPolicy, *, fsync: bool = False) -> None:
        self.defaults = defaults
        self.fsync = fsync
        self._fs: LocalDir | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, JobPolicy] = {}
        self.check_redundancy: Callable[[int, tuple[int, int] | None], None] | None = None
        """Installed by the peer tier: raises InvalidArgumentError (naming ``policy.redundancy``)
        for a choice this cluster cannot serve (more replicas than peers, a group larger than it)."""

    def load(self, fs: LocalDir) -> None:
        """Read every ``policies/<job>.json`` of the local dir (the store's start-up calls it).
        A malformed file is logged and ignored (the defaults apply)."""
        self._fs = fs
        with fs.dir((POLICY_DIR,), create=True) as dfd:
            for name, kind in fs.entries(dfd):
                job = name[:-len(".json")]
                if kind != "file" or not name.endswith(".json") or not JOB_RE.fullmatch(job):
                    continue
                try:
                    doc = json.loads(fs.read_small(dfd, name, _MAX_BYTES))
                    pol = JobPolicy(**{k: doc.get(k) for k in _FIELDS}).checked()
                except (OSError, ValueError, TypeError, AttributeError, InvalidArgumentError) as e:
                    log.error("ignoring policy file %s/%s: %s", POLICY_DIR, name, e)
                    continue
                self._jobs[job] = pol
        if self._jobs:
            log.info("per-job policies loaded for %d jobs", len(self._jobs))

    def get(self, job: str) -> JobPolicy:
        """The job's overrides (fields unset where the daemon's flag applies)."""
        with self._lock:
            return self._jobs.get(job, JobPolicy())

    def effective(self, job: str) -> JobPolicy:
        """What applies to ``job``: its overrides, else the defaults."""
        return self.defaults.merged(self.get(job))

    def keep_local(self, job: str) -> int:
        return int(self.effective(job).keep_local or 1)

    def keep_persistent(self, job: str, default: int | None = None) -> int:
        """The job's override, else ``default`` (the persistent tier's flag), else the defaults."""
        v = self.get(job).keep_persistent
        return int(v if v is not None else default if default is not None else self.defaults.keep_persistent or 0)

    def persist_every(self, job: str, default: int | None = None) -> int:
        """The job's override, else ``default`` (the persistent tier's flag), else the defaults."""
        v = self.get(job).persist_every
        return int(v if v is not None else default if default is not None else self.defaults.persist_every or 0)

    def redundancy(self, job: str) -> tuple[int, tuple[int, int] | None] | None:
        """The job's ``redundancy`` override as (R, None) or (0, (K, M)); None: the daemon's."""
        v = self.get(job).redundancy
        return parse_job_redundancy(v) if v is not None else None

    def update(self, job: str, policy: JobPolicy, *, reset: bool = False) -> JobPolicy:
        """Apply ``policy``'s set fields to the job's overrides (after dropping them all with
        ``reset``); write the file when something changed. Returns the new overrides.

        Raises:
            InvalidArgumentError: a field is out of range (the message names it).
        """
        policy.checked()
        if policy.redundancy is not None and self.check_redundancy is not None:
            self.check_redundancy(*parse_job_redundancy(policy.redundancy))
        with self._lock:
            old = self._jobs.get(job, JobPolicy())
            new = (JobPolicy() if reset else old).merged(policy)
            if new == old:
                return new
            self._write(job, new)
            if new.is_empty():
                self._jobs.pop(job, None)
            else:
                self._jobs[job] = new
        log.info("policy of job %s set to %s", job, _describe(new))
        return new

    def _write(self, job: str, pol: JobPolicy) -> None:
        if self._fs is None:  # a store never opened (unit tests): in memory only
            return
        try:
            with self._fs.dir((POLICY_DIR,), create=True) as dfd:
                if pol.is_empty():
                    self._fs.unlink(dfd, f"{job}.json")
                else:
                    data = json.dumps({k: v for k, v in asdict(pol).items() if v is not None}).encode()
                    self._fs.atomic_write(dfd, f"{job}.json", data, fsync=self.fsync)
        except UnsafeFileError as e:
            raise InvalidArgumentError(f"job: cannot keep the policy of {job}: {e.strerror}") from None


def _describe(pol: JobPolicy) -> str:
    parts: list[Any] = [f"{k}={v}" for k, v in asdict(pol).items() if v is not None]
    return ", ".join(parts) or "the daemon's defaults"
