"""A persistent tier that cannot work is probed at start-up and shown degraded, not fatal: in
``status`` (``persistent_error``), in the health service (``tierckpt.persistent`` NOT_SERVING)
and in ``tierckpt_tier_up{tier="persistent"}``; local saves keep working."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..harness import free_port
from ..metrics_scrape import scrape as _metrics
from ..servers import make_backend_target

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(d, service: str) -> int:
    with grpc.insecure_channel(d.address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _start(daemon_factory, url: str, env: dict[str, str] | None = None):
    mport = free_port()
    d = daemon_factory("n0", args=("--persistent", url, "--persist-every", "1", "--metrics-port", str(mport)),
                       env=env)
    return d, mport


def _assert_degraded(d, mport: int, why: str) -> str:
    with d.client() as c:
        st = c.status()
        assert why in st.persistent_error, st.persistent_error
        c.save("job", 1, 0, 1, {"x": b"still saved locally"}).result(30)  # local saves go on
        assert c.restore("job", 0).tier == "local"
    assert _health(d, "") == SERVING and _health(d, "tierckpt.local") == SERVING
    assert _health(d, "tierckpt.persistent") == NOT_SERVING
    m = _metrics(mport)
    assert m['tierckpt_tier_up{tier="persistent"}'] == 0 and m['tierckpt_tier_up{tier="local"}'] == 1
    cli = subprocess.run([sys.executable, "-m", "tierckpt.cli", "--address", d.address, "status"],
                         capture_output=True, text=True, timeout=60)
    assert "DEGRADED" in cli.stdout and why in cli.stdout, cli.stdout + cli.stderr
    return st.persistent_error


def test_file_tier_that_cannot_be_written_is_degraded(daemon_factory, scratch: Path) -> None:
    (scratch / "plain-file").write_text("")
    d, mport = _start(daemon_factory, (scratch / "plain-file" / "store").as_uri())
    _assert_degraded(d, mport, "plain-file")


def test_s3_missing_bucket_is_degraded(daemon_factory, request, tmp_path, monkeypatch) -> None:
    target = make_backend_target("s3", request, tmp_path, monkeypatch)
    url = target.url.replace("s3://", "s3://no-such-bucket-").split("/ckpt")[0] + "/ckpt"
    d, mport = _start(daemon_factory, url, {**os.environ, **target.env})
    _assert_degraded(d, mport, "NoSuchBucket")


def test_s3_without_credentials_is_degraded(daemon_factory, request, tmp_path, monkeypatch) -> None:
    target = make_backend_target("s3", request, tmp_path, monkeypatch)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)  # the daemon's environment is this process's plus env
        target.env.pop(var)
    d, mport = _start(daemon_factory, target.url, target.env)
    error = _assert_degraded(d, mport, "credentials")
    assert "testing" not in error


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_working_tier_is_up(daemon_factory, request, tmp_path, monkeypatch, kind: str) -> None:
    target = make_backend_target(kind, request, tmp_path, monkeypatch)
    d, mport = _start(daemon_factory, target.url, {**os.environ, **target.env})
    with d.client() as c:
        assert c.status().persistent_error == ""
        c.save("job", 1, 0, 1, {"x": b"abc"}).wait("persistent", timeout=60)
    assert _health(d, "tierckpt.persistent") == SERVING
    assert _metrics(mport)['tierckpt_tier_up{tier="persistent"}'] == 1
    if kind == "file":  # the probe leaves nothing behind
        probes = Path(target.url[len("file://"):]) / ".tierckpt-probe"
        assert not probes.exists() or not list(probes.iterdir())
    assert d.terminate() == 0


def test_probe_loop_recovers_and_reports_changes(monkeypatch) -> None:
    """While degraded the tier is probed again; the first success brings it up everywhere."""
    import asyncio

    from tierckptd import tierhealth
    from tierckptd.metrics import Metrics

    monkeypatch.setattr(tierhealth, "RETRY_SECONDS", 0.01)
    monkeypatch.setattr(tierhealth, "RECHECK_SECONDS", 0.01)
    outcomes = [RuntimeError("NoSuchBucket: s3://b/p"), None]
    health_calls: list[tuple[str, bool]] = []

    async def probe() -> None:
        if outcomes:
            err = outcomes.pop(0)
            if err:
                raise err

    async def set_health(service: str, serving: bool) -> None:
        health_calls.append((service, serving))

    async def run() -> tierhealth.TierHealth:
        m = Metrics()
        th = tierhealth.TierHealth(["local", "persistent"], m, set_health)
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(tierhealth.probe_loop(th, "persistent", probe, first))
        assert await first is False and "NoSuchBucket" in (th.error("persistent") or "")
        assert 'tierckpt_tier_up{tier="persistent"} 0.0' in m.render().decode()
        while th.error("persistent"):
            await asyncio.sleep(0.01)
        assert 'tierckpt_tier_up{tier="persistent"} 1.0' in m.render().decode()
        task.cancel()
        return th

    th = asyncio.run(run())
    assert th.up("persistent") and th.up("local") and not th.up("peer")
    assert ("tierckpt.persistent", False) in health_calls and health_calls[-1] == ("tierckpt.persistent", True)
