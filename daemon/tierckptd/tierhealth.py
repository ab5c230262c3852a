"""Whether each configured tier can do its work, shown in three places at once.

A tier that cannot work (the persistent tier's object store refuses this daemon's credentials,
has no such bucket, or may not be written) is *degraded*, not fatal: local saves and peer
copies keep working, and the drain queue keeps what waits for the object store on disk. The
state shows in ``tierckpt status`` (``StatusResponse.persistent_error``), in the health service
(service ``tierckpt.<tier>`` is NOT_SERVING; the overall service stays SERVING) and in the
metric ``tierckpt_tier_up{tier}``.

The persistent tier is probed at start-up (a small object put and deleted under the prefix),
then again every :data:`RETRY_SECONDS` while it fails and every :data:`RECHECK_SECONDS` while
it works.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .knobs import KNOBS
from .redact import redact_text

__all__ = ["TierHealth", "probe_loop", "RETRY_SECONDS", "RECHECK_SECONDS", "FIRST_PROBE_WAIT"]

log = logging.getLogger(__name__)

RETRY_SECONDS = 30.0
"""Seconds between probes of a degraded tier."""
RECHECK_SECONDS = 300.0
"""Seconds between probes of a working tier."""
FIRST_PROBE_WAIT = 10.0
"""Seconds start-up waits for the first probe before it reports ready (the probe goes on)."""

SetHealth = Callable[[str, bool], Awaitable[None]]


class TierHealth:
    """Per-tier error state; every change updates the metric and the health service.

    Args:
        tiers: the configured tiers (``local`` always), all up until told otherwise.
        metrics: optional :class:`~tierckptd.metrics.Metrics` (``tier_up``).
        set_health: optional coroutine ``(service, serving)`` of the health service.
    """

    def __init__(self, tiers: list[str], metrics: Any = None, set_health: SetHealth | None = None) -> None:
        self._errors: dict[str, str | None] = {t: None for t in tiers}
        self.metrics = metrics
        self.set_health = set_health
        if metrics is not None:
            for t in tiers:
                metrics.tier_up.labels(t).set(1)

    @staticmethod
    def service(tier: str) -> str:
        """The health service name of a tier."""
        return f"tierckpt.{tier}"

    def services(self) -> list[str]:
        return [self.service(t) for t in self._errors]

    def error(self, tier: str) -> str | None:
        """Why ``tier`` is degraded, or None when it works (or is not configured)."""
        return self._errors.get(tier)

    def up(self, tier: str) -> bool:
        return tier in self._errors and self._errors[tier] is None

    async def report(self, tier: str, error: str | None) -> None:
        """Record the outcome of a check of ``tier``; logs a change of state once."""
        before = self._errors.get(tier, "unknown")
        self._errors[tier] = error
        if self.metrics is not None:
            self.metrics.tier_up.labels(tier).set(0 if error else 1)
        if self.set_health is not None:
            await self.set_health(self.service(tier), error is None)
        if error and error != before:
            log.error("%s tier degraded: %s (local saves go on; retried every %.0f s)", tier, error,
                      RETRY_SECONDS, extra={"tier": tier})
        elif not error and before:
            log.info("%s tier is up", tier, extra={"tier": tier})

    async def serving(self, serving: bool) -> None:
        """Every tier's service follows the daemon's (NOT_SERVING while it shuts down)."""
        if self.set_health is None:
            return
        for tier, error in self._errors.items():
            await self.set_health(self.service(tier), serving and error is None)


async def probe_once(health: TierHealth, tier: str, probe: Callable[[], Awaitable[None]], timeout: float) -> bool:
    """Run ``probe()`` once within ``timeout`` and report the outcome; returns whether it passed."""
    try:
        await asyncio.wait_for(probe(), timeout)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        await health.report(tier, f"the object store did not answer within {timeout:.0f} s")
        return False
    except Exception as e:  # any failure of the SDK is the finding, not a crash
        await health.report(tier, redact_text(str(e)) or type(e).__name__)
        return False
    await health.report(tier, None)
    return True


async def probe_loop(health: TierHealth, tier: str, probe: Callable[[], Awaitable[None]],
                     first: asyncio.Future | None = None, timeout: float = 60.0) -> None:
    """Probe ``tier`` now and then forever (see the module docstring); ``first`` gets the first result."""
    while True:
        ok = await probe_once(health, tier, probe, timeout)
        if first is not None and not first.done():
            first.set_result(ok)
        await asyncio.sleep(KNOBS.debug_probe_interval or (RECHECK_SECONDS if ok else RETRY_SECONDS))
