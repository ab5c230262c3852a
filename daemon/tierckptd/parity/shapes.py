"""Parity codes per job: the daemon's ``redundancy`` is the default, a job's policy may choose
another (``redundancy = "replicas:R"`` or ``"parity:K+M"``, :mod:`tierckptd.local.policies`).

Why several codes on one node: the choice is made per job at the rank's owner, but a protector
serves the owners of every job, so a node holds one :class:`.facade.Parity` per K+M in use (at
most ``MAX_CODES``), created when first needed: when this node owns a rank of a job that chose
it, when an owner asks it to protect a chunk under it (``ProtectRank`` carries the owner's K+M),
or when a restore finds it in the protectors' answers. The daemon's own code keeps its parity
where it always did (``<local_dir>/parity``, ``parity-rs``); the others each under a directory of
their own, ``<local_dir>/parity-K+M/`` (so two codes never share a slot directory), found again at
start-up. A protector that cannot serve a K+M (a group larger than the cluster, too many codes)
answers FAILED_PRECONDITION: the owner's ``wait("peer")`` then fails naming it, and the owner's
status says the parity is pending (no silent fallback to replicas).

Restore does not need to know the job's policy (a replaced node has lost it): the protectors'
``ParityLookup`` answers say the K+M each rank is protected under (``all_shapes``), and the
rebuild runs in that code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable, Coroutine
from typing import Any

from tierckpt.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
    UnavailableError,
)
from tierckpt.v1 import peer_pb2 as ppb

from ..cluster.membership import Membership
from ..config import ConfigError, DaemonConfig, parse_redundancy
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..offload import run_blocking
from ..tiers import RankCopy
from .facade import Parity
from .holding import HeldRequests
from .takeover import ParityTakeOver

__all__ = ["ParityShapes", "MAX_CODES"]

log = logging.getLogger(__name__)

MAX_CODES = 4
"""Parity codes one node keeps at once (each a store, an encoder, a protector): bounds what
hostile ``ProtectRank`` requests can make a node create."""

_DIR_RE = re.compile(r"^parity-(\d{1,3})\+(\d{1,2})$")

Shape = tuple[int, int]
Copies = dict[int, dict[int, RankCopy]]


def shape_dir(shape: Shape) -> str:
    return f"parity-{shape[0]}+{shape[1]}"


class ParityShapes:
    """The parity codes of one node, and which one a job's ranks use.

    Args:
        choose: the K+M a job's ranks are protected under at this node, None for replicas.
        persistent: returns the persistent tier or None (the take-over of lost owners' ranks).
    """

    def __init__(self, config: DaemonConfig, store: LocalStore, cluster: Membership, receiver: Any,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task], metrics: Any,
                 choose: Callable[[str], Shape | None], persistent: Callable[[], Any], transfer: Any = None) -> None:
        self.config, self.store, self.cluster, self.receiver = config, store, cluster, receiver
        self.transfer = transfer  # the peer tier's bulk transfers, which every code's rebuilds pull over
        self._spawn, self.metrics, self.choose, self._persistent = spawn, metrics, choose, persistent
        self.node_id = config.node_id
        self.own: Shape | None = config.parity
        self._codes: dict[Shape, Parity] = {}
        self.takeovers: dict[Shape, ParityTakeOver] = {}
        self._started = False
        self.held = HeldRequests(self)  # the holder side of the peer RPCs, routed to the right code
        if self.own is not None:
            self._add(self.own, None)
        store.external_charge = self.nbytes  # parity counts against local_capacity (retention evicts for it)

    # ------------------------------------------------------------------------------ the codes

    def _add(self, shape: Shape, root: str | None) -> Parity:
        p = Parity(self.config, self.store, self.cluster, self.receiver, self._spawn, self.metrics,
                   self.transfer, shape=shape, root=root)
        p.encoder.wants = lambda job, shape=shape: self.choose(job) == shape  # type: ignore[misc]
        self._codes[shape] = p
        self.takeovers[shape] = ParityTakeOver(p, self._persistent)
        return p

    def codes(self) -> list[Parity]:
        """Every code held, the daemon's own first."""
        return sorted(self._codes.values(), key=lambda p: (p.k, p.m) != self.own)

    def get(self, shape: Shape | None) -> Parity | None:
        return self._codes.get(shape) if shape is not None else None

    def check(self, shape: Shape, field: str) -> None:
        """Whether this node can serve ``shape``: InvalidArgumentError (a K+M no daemon accepts) or
        FailedPreconditionError (not on this cluster, or too many codes here), naming ``field``."""
        try:
            parse_redundancy(f"parity:{shape[0]}+{shape[1]}")
        except ConfigError as e:
            raise InvalidArgumentError(f"{field}: {str(e).partition(': ')[2]}") from None
        n = len(self.cluster.ids())
        if sum(shape) > n:
            raise FailedPreconditionError(f"{field}: parity:{shape[0]}+{shape[1]} needs a group of {sum(shape)} "
                                          f"nodes; the cluster has {n}")
        if shape not in self._codes and len(self._codes) >= MAX_CODES:
            raise FailedPreconditionError(f"{field}: node {self.node_id} already holds {MAX_CODES} parity codes "
                                          f"({', '.join(f'parity:{k}+{m}' for k, m in self._codes)})")

    def obtain(self, shape: Shape, field: str = "redundancy") -> Parity:
        """The code of ``shape``, created (its store opened: an empty directory the first time)."""
        p = self._codes.get(shape)
        if p is not None:
            return p
        self.check(shape, field)
        p = self._add(shape, os.path.join(self.store.root, shape_dir(shape)))
        p.pstore.open()  # blocking, but once per code and process: a new code's directory is empty
        log.info("peer tier: parity:%d+%d held for the jobs that chose it, group %s", shape[0], shape[1],
                 ",".join(p.group()))
        if self._started:
            self._spawn(self.takeovers[shape].watch())
            self.watch()
        return p

    def of_job(self, job: str) -> Parity | None:
        """The code protecting ``job``'s ranks owned here; None: replicas (or a K+M this node
        cannot serve, logged: the ranks stay unprotected by parity and ``wait`` says so)."""
        shape = self.choose(job)
        if shape is None:
            return None
        try:
            return self.obtain(shape)
        except TierckptError as e:
            log.error("job %s: its redundancy parity:%d+%d cannot be served here: %s", job, shape[0], shape[1], e)
            return None

    def nbytes(self) -> int:
        """Parity held here for peers, and the chunks being decoded here for restoring nodes."""
        return sum(p.pstore.nbytes() + p.far.held for p in list(self._codes.values()))

    def watch(self) -> None:
        """Watch every code's group (their health decides catch-up and take-over)."""
        self.cluster.also_watch = {n for p in self._codes.values() for n in p.group()} - {self.node_id}

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for shape in await run_blocking(self._found_dirs):
            if shape not in self._codes:
                try:
                    self.check(shape, "redundancy")
                except TierckptError as e:
                    log.error("parity kept under %s is not served (%s): its slots stay on disk", shape_dir(shape), e)
                    continue
                self._add(shape, os.path.join(self.store.root, shape_dir(shape)))
        for p in self.codes():
            await p.start()
        for job in self.store.jobs():  # owners of jobs that chose a code: it serves their pulls at once
            self.of_job(job)
        self._started = True
        self.watch()
        for t in self.takeovers.values():
            self._spawn(t.watch())

    def _found_dirs(self) -> list[Shape]:
        out = []
        with os.scandir(self.store.root) as it:
            for e in it:
                m = _DIR_RE.match(e.name)
                if m and e.is_dir(follow_symlinks=False):
                    out.append((int(m.group(1)), int(m.group(2))))
        return sorted(out)

    def cancel_all(self) -> list[asyncio.Task]:
        return [t for p in self._codes.values() for t in p.encoder.cancel_all()]

    # ------------------------------------------------------------------------------ owner side

    def on_commit(self, man: Manifest) -> None:
        if man.node == self.node_id and (p := self.of_job(man.job)) is not None:
            p.encoder.ensure(man)

    def catch_up(self) -> None:
        for p in self.codes():
            p.catch_up()
        self.watch()

    async def audit(self) -> None:
        for p in self.codes():
            await p.audit()

    def on_evict(self, eviction: Eviction) -> None:
        for p in self.codes():
            p.on_evict(eviction)

    def protected(self, man: Manifest) -> bool:
        return any(p.encoder.protected(man) for p in self.codes())

    async def wait(self, man: Manifest) -> list[str]:
        p = self.of_job(man.job)
        if p is None:
            shape = self.choose(man.job)
            raise UnavailableError(f"{man.job} step {man.step} rank {man.rank}: its redundancy "
                                   f"parity:{shape[0]}+{shape[1]} cannot be served on this cluster" if shape else
                                   f"{man.job} uses replicas")
        return await p.encoder.wait(man)

    def pending(self) -> list[float]:
        return [a for p in self.codes() for a in p.encoder.pending()]

    # ------------------------------------------------------------------------------ restore

    async def discover(self, job: str, step: int | None, rank: int | None, nodes: set[str] | None) -> list[Shape]:
        """The K+M the peers (``nodes``, else all) protect ``job``'s ranks under (restore on a node
        that does not know the job's policy)."""
        req = ppb.ParityLookupRequest(requester=self.node_id, job=job, has_step=step is not None, step=step or 0,
                                      has_rank=rank is not None, rank=rank or 0, all_shapes=True)
        answers, _ = await self.cluster.fan_out("ParityLookup", req, nodes)
        found = {(r.parity_k, r.parity_m) for _, resp in answers for r in resp.ranks if r.parity_k and r.parity_m}
        return sorted(found)

    def _known(self, job: str) -> list[Parity]:
        """The codes held here, the job's first."""
        out = [p for p in [self.of_job(job)] if p is not None]
        return out + [p for p in self.codes() if p not in out]

    async def candidates(self, job: str, step: int | None, rank: int | None,
                         nodes: set[str] | None) -> list[Parity]:
        """The codes that may protect ``job``'s ranks: the job's, those held here, those the peers
        answer for (created here: the rebuild runs in the code the rank was protected under)."""
        out = self._known(job)
        try:
            shapes = await self.discover(job, step, rank, nodes)
        except TierckptError as e:
            log.info("parity codes of %s: lookup failed: %s", job, e)
            shapes = []
        for shape in shapes:
            try:
                p = self.obtain(shape, "parity_k/parity_m")
            except TierckptError as e:
                log.warning("parity:%d+%d of %s found on peers cannot be rebuilt here: %s", *shape, job, e)
                continue
            if p not in out:
                out.append(p)
        return out

    async def copies(self, job: str, nodes: set[str] | None, rank: int | None, job_owner: str | None) -> Copies:
        from .peertier import merge_copies

        out: Copies = {}
        for p in await self.candidates(job, None, rank, nodes):
            out = merge_copies(out, await p.copies(job, nodes, rank, job_owner))
        return out

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None, otherwise: TierckptError) -> Manifest:
        """The rank rebuilt from the first code whose protectors hold it; ``otherwise`` (the full
        copy's failure) where no code is held here or found on the peers.

        The codes held here (the job's, the daemon's own) are tried first, each asking its group
        only; every peer is asked which K+M protects the rank (``ParityLookup``, O(N)) only where
        none of them has it: a node that lost the job's policy with its local dir."""
        known = self._known(job)
        errors: list[TierckptError] = []
        man = await self._rebuilt(known, job, step, rank, job_owner, errors)
        if man is None:
            found = [p for p in await self.candidates(job, step, rank, None) if p not in known]
            if not known and not found:
                raise otherwise
            man = await self._rebuilt(found, job, step, rank, job_owner, errors)
        if man is not None:
            return man
        # found but not rebuildable in some code comes before "not found"
        raise next((e for e in errors if not isinstance(e, NotFoundError)), None) or (
            errors[0] if errors else NotFoundError(f"{job} step {step} rank {rank} is not protected by parity on "
                                                   "any live peer"))

    @staticmethod
    async def _rebuilt(codes: list[Parity], job: str, step: int, rank: int, job_owner: str | None,
                       errors: list[TierckptError]) -> Manifest | None:
        """The rank rebuilt by the first of ``codes`` whose protectors hold it; None (each
        failure added to ``errors``) where none does."""
        for p in codes:
            try:
                return await p.rebuilder.fetch(job, step, rank, job_owner)
            except TierckptError as e:
                errors.append(e)
        return None

    async def drop_local(self, job: str, step: int) -> int:
        return sum([await p.drop_local(job, step) for p in self.codes()])

    def status(self) -> dict:
        out: dict[str, Any] = {}
        own = self.get(self.own)
        if own is not None:
            out.update(own.status())
        others = [p for p in self.codes() if p is not own]
        if others:
            out["job_parity"] = {f"parity:{p.k}+{p.m}": p.status() for p in others}
            out["parity_bytes"] = self.nbytes()
        return out

