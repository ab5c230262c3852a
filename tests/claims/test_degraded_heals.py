"""README, "Deploying the daemon": the persistent tier is probed while the daemon runs; a failure
does not stop it (local saves go on, drains wait in the queue) but shows as a degraded tier —
``tierckpt status`` prints ``DEGRADED: why``, the health service ``tierckpt.persistent`` answers
NOT_SERVING while the overall service stays SERVING, ``tierckpt_tier_up{tier="persistent"}`` is
0 — and a tier that works again is shown up again, without a restart, and the queued drains
complete ("an outage delays drains and loses nothing"). tests/ops/test_degraded.py checks a tier
degraded from start-up and the probe loop in process; here one real daemon loses its S3 (moto)
endpoint while running and gets it back. The probe interval is shortened with the
``debug_probe_interval`` knob (30 s / 5 min by default)."""

from __future__ import annotations

import re
import subprocess
import sys

from ..harness import free_port, wait_until
from ..servers import make_backend_target
from ._util import NOT_SERVING, SERVING, Proxy, bucket_keys, health, metrics, noise

UP = 'tierckpt_tier_up{tier="persistent"}'


def _cli_status(address: str) -> str:
    p = subprocess.run([sys.executable, "-m", "tierckpt.cli", "--address", address, "status"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_a_tier_that_fails_while_running_shows_degraded_and_heals_without_a_restart(
        daemon_factory, request, tmp_path, monkeypatch) -> None:
    s3 = make_backend_target("s3", request, tmp_path, monkeypatch)
    proxy = Proxy(("127.0.0.1", s3.server.port))
    mport = free_port()
    env = {**s3.env, "AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
    try:
        d = daemon_factory(env=env, args=("--persistent", s3.url, "--persist-every", "1", "--metrics-port",
                                          str(mport), "--knobs", "debug_probe_interval=0.3"))
        pid = d.proc.pid
        with d.client() as c:
            assert c.status().persistent_error == ""
            assert health(d.address, "tierckpt.persistent") == SERVING and metrics(mport)[UP] == 1
            c.save("job", 1, 0, 1, {"x": noise(50_000, 1)}).wait("persistent", timeout=60)

            proxy.cut()  # the object store is unreachable
            why = wait_until(lambda: c.status().persistent_error, 30, "the tier to show degraded")
            wait_until(lambda: health(d.address, "tierckpt.persistent") == NOT_SERVING, 10, "NOT_SERVING")
            assert health(d.address, "") == SERVING and health(d.address, "tierckpt.local") == SERVING
            assert metrics(mport)[UP] == 0
            assert proxy.url in why, why  # the error names the endpoint it could not reach
            text = _cli_status(d.address)  # (each probe's message names its own probe key; the cut can
            # come between the probe's put and its delete, so either one is the call that failed)
            assert re.search(rf"persistent tier: {re.escape(s3.url)}: DEGRADED: (put|delete) "
                             rf"{re.escape(s3.url)}/\.tierckpt-probe/", text), text
            assert proxy.url in text, text
            fut = c.save("job", 2, 0, 1, {"x": noise(50_000, 2)})  # local saves go on
            fut.result(30)
            assert bytes(c.restore("job", 0, step=2).shards["x"]) == noise(50_000, 2)
            assert c.status().drain_backlog_steps == 1  # the drain waits in the queue

            proxy.heal()  # the store is back: up again, no restart
            wait_until(lambda: c.status().persistent_error == "", 30, "the tier to show up again")
            wait_until(lambda: health(d.address, "tierckpt.persistent") == SERVING, 10, "SERVING again")
            assert metrics(mport)[UP] == 1
            assert "DEGRADED" not in _cli_status(d.address)
            fut.wait("persistent", timeout=60)  # the queued drain completes
            wait_until(lambda: c.status().drain_backlog_steps == 0, 30, "an empty backlog")
        assert d.alive() and d.proc.pid == pid
        bucket, prefix = s3.url[len("s3://"):].split("/", 1)
        manifests = bucket_keys(s3.server, bucket, f"{prefix}/job/manifests/")
        assert sorted(k.split("/")[3] for k in manifests) == [f"{1:020d}", f"{2:020d}"]
    finally:
        proxy.close()
