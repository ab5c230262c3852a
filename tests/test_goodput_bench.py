"""bench/goodput.py: the failure schedule and the wall-time accounting, on synthetic trainer logs.

The benchmark itself runs for minutes (``--quick``: about one); these tests cover its pure parts.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
_SPEC = importlib.util.spec_from_file_location("bench_goodput", _BENCH / "goodput.py")
gp = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = gp  # dataclasses look their module up
_SPEC.loader.exec_module(gp)  # type: ignore[union-attr]

FRACTIONS = {"crash": 0.6, "node": 0.3, "cluster": 0.1}


def test_schedule_is_seeded_increasing_and_follows_the_mix() -> None:
    a = list(itertools.islice(gp.failure_schedule(1, 30.0, FRACTIONS), 4000))
    assert a == list(itertools.islice(gp.failure_schedule(1, 30.0, FRACTIONS), 4000))
    assert a != list(itertools.islice(gp.failure_schedule(2, 30.0, FRACTIONS), 4000))
    times = [f.at_s for f in a]
    assert all(t1 > t0 for t0, t1 in itertools.pairwise(times))
    assert statistics.mean(t1 - t0 for t0, t1 in itertools.pairwise(times)) == pytest.approx(30.0, rel=0.1)
    for kind, share in FRACTIONS.items():
        assert sum(f.kind == kind for f in a) / len(a) == pytest.approx(share, abs=0.03)


def _log(path: Path, events: list[tuple]) -> Path:
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"event": e[0], "t": e[1], **(e[2] if len(e) > 2 else {})}) + "\n" for e in events)
        fh.write('{"event": "step", "t": 9')  # a line cut short by SIGKILL is ignored
    return path


def _steps(first: int, last: int, t0: float, dt: float, saves: dict[int, float]) -> list[tuple]:
    """Step events every ``dt`` (plus the stall of a save at the step before)."""
    out, t = [], t0
    for s in range(first, last + 1):
        out.append(("step", t, {"step": s, "loss": 1.0 / s}))
        if s in saves:
            out.append(("save", t, {"step": s, "persist": False, "blocking_s": saves[s]}))
            t += saves[s]
        t += dt
    return out


def test_account_splits_wall_time(tmp_path: Path) -> None:
    dt = 0.1
    # Run 0: spawned at 0, first line at 3, steps 1..25 from 3.2 (saves at 10 and 20 stall 0.3 s),
    # killed by a node loss 0.05 s after its last step; the daemon is replaced in 0.4 s. Run 1:
    # spawned then, first line 3 s later, restores step 20 in 0.5 s, steps 21..30, exits 1 s later.
    ev0 = [("start", 3.0), ("restore", 3.1, {"step": None}), *_steps(1, 25, 3.2, dt, {10: 0.3, 20: 0.3})]
    run0 = gp.Incarnation(0.0, _log(tmp_path / "0.jsonl", ev0), end_t=ev0[-1][1] + 0.05, killed_by="node",
                          replacement_s=0.4)
    t1 = run0.end_t + 0.4
    ev1 = [("start", t1 + 3.0), ("restore", t1 + 3.5, {"step": 20, "tier": "peer"}), *_steps(21, 30, t1 + 3.6, dt, {})]
    run1 = gp.Incarnation(t1, _log(tmp_path / "1.jsonl", ev1), end_t=ev1[-1][1] + 1.0)
    a = gp.account([run0, run1], 30)

    assert a["step_s"] == pytest.approx(dt)
    assert a["wall_s"] == pytest.approx(3.1 + 25 * dt + 0.6 + 0.05 + 0.4 + 3.0 + 0.5 + 10 * dt + 1.0)
    assert a["useful_s"] == pytest.approx(3.0)
    assert a["startup_s"] == pytest.approx(3.1)
    assert a["restart_s"] == pytest.approx(3.0)
    assert a["restore_s"] == pytest.approx(0.5)
    assert (a["saves"], a["save_s"]) == (2, pytest.approx(0.6))
    assert a["replacement_s"] == pytest.approx(0.4)
    assert a["recomputed_steps"] == 5
    assert a["partial_s"] == pytest.approx(0.05)
    assert a["lost_s"] == pytest.approx(0.55)
    assert a["exit_s"] == pytest.approx(1.0)
    assert a["failures"] == {"crash": 0, "node": 1, "cluster": 0}
    assert a["restored_from"] == {"peer": 1}
    assert a["final_loss"] == pytest.approx(1 / 30)
    assert a["other_s"] == pytest.approx(0.0, abs=1e-9)
    assert a["goodput"] == pytest.approx(3.0 / a["wall_s"])


def test_save_costs_charge_slow_steps_after_a_save(tmp_path: Path) -> None:
    ev = [("start", 0.0), ("restore", 0.1, {"step": None}), *_steps(1, 31, 1.0, 0.1, {})]
    # Saves at 5, 15, 25 (local) and 10, 20 (persist): 10 ms stall; each local save's next step is
    # 50 ms slower, each persist save's next two steps are.
    at = {e[2]["step"]: e[1] for e in ev if e[0] == "step"}
    shift, out = 0.0, []
    for e in ev:
        if e[0] == "step":
            s = e[2]["step"]
            shift += 0.05 if (s - 1) in (5, 15, 25, 10, 20) or (s - 2) in (10, 20) else 0.0
            out.append(("step", at[s] + shift, e[2]))
            if s % 5 == 0 and s <= 25:
                out.append(("save", at[s] + shift, {"step": s, "persist": s % 10 == 0, "blocking_s": 0.01}))
        else:
            out.append(e)
    costs = gp.save_costs([gp.Incarnation(0.0, _log(tmp_path / "c.jsonl", out))])
    assert costs["local_stall_s"] == pytest.approx(0.01)
    assert costs["local_cost_s"] == pytest.approx(0.05)
    assert costs["persist_cost_s"] == pytest.approx(0.10)


# ---------------------------------------------------------------------------------------------- throttle

_TSPEC = importlib.util.spec_from_file_location("bench_throttle", _BENCH / "_throttle.py")
thr = importlib.util.module_from_spec(_TSPEC)
_TSPEC.loader.exec_module(thr)  # type: ignore[union-attr]


def test_token_bucket_spends_the_burst_then_paces() -> None:
    now = [0.0]
    b = thr.TokenBucket(rate=100.0, burst=50.0, clock=lambda: now[0])
    assert b.delay(50) == 0.0  # the burst is free
    assert b.delay(100) == pytest.approx(1.0)  # then rate-limited, in debt
    now[0] = 1.0
    assert b.delay(100) == pytest.approx(1.0)  # the debt was repaid, this one waits its own second
    now[0] = 100.0
    assert b.delay(0) == 0.0 and b.tokens == pytest.approx(50.0)  # refills no deeper than the burst


def test_proxy_relays_both_ways_at_the_limit() -> None:
    import asyncio
    import time

    payload = bytes(range(256)) * 4096  # 1 MiB
    rate = 4 * 2**20

    async def scenario() -> tuple[float, bytes]:
        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(await r.readexactly(len(payload)))
            await w.drain()
            w.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        tport = target.sockets[0].getsockname()[1]
        # serve()'s relay, with its two shared buckets, in this event loop.
        up, down = thr.TokenBucket(rate, rate * 0.01), thr.TokenBucket(rate, rate * 0.01)

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            tr, tw = await asyncio.open_connection("127.0.0.1", tport)
            await asyncio.gather(thr._pipe(cr, tw, up), thr._pipe(tr, cw, down))

        proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
        t0 = time.monotonic()
        w.write(payload)
        await w.drain()
        got = await r.readexactly(len(payload))
        elapsed = time.monotonic() - t0
        w.close()
        proxy.close()
        target.close()
        return elapsed, got

    elapsed, got = asyncio.run(scenario())
    assert got == payload
    # 1 MiB up, then (the echo reads it all first) 1 MiB back, at 4 MiB/s each: about 0.5 s.
    assert elapsed >= 0.4


def test_dcp_store_keeps_the_two_newest_complete_steps(tmp_path: Path) -> None:
    for step, complete in ((10, True), (20, True), (30, False), (40, True), (50, False)):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        if complete:
            (d / ".metadata").write_bytes(b"x")
    (tmp_path / "step-00000060.tmp").mkdir()  # a directory save cut short: never a step
    store = gp.DcpStore(str(tmp_path))
    assert store.steps() == [10, 20, 30, 40, 50]
    assert store.complete() == [10, 20, 40]
    store.prune()
    assert store.steps() == [20, 30, 40, 50]  # 30 and 50 may still be uploading: kept
    assert store.complete() == [20, 40]


def test_dcp_store_on_s3_lists_and_prunes_like_the_directory(moto_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The s3torchconnector arm's housekeeping (boto3 listing and deletion; no s3torchconnector
    needed): the same complete / incomplete rule as the directory store, on real S3 objects."""
    import boto3

    for k, v in moto_server.env.items():
        monkeypatch.setenv(k, v)
    bucket = moto_server.create_bucket()
    s3 = boto3.client("s3")
    for step, complete in ((10, True), (20, True), (30, False), (40, True), (50, False)):
        s3.put_object(Bucket=bucket, Key=f"dcp/step-{step:08d}/__0_0.distcp", Body=b"data")
        if complete:
            s3.put_object(Bucket=bucket, Key=f"dcp/step-{step:08d}/.metadata", Body=b"x")
    s3.put_object(Bucket=bucket, Key="dcp-other/step-00000070/.metadata", Body=b"x")  # a sibling prefix
    store = gp.DcpStore(f"s3://{bucket}/dcp", "s3torchconnector")
    assert store.steps() == [10, 20, 30, 40, 50]
    assert store.complete() == [10, 20, 40]
    store.prune()
    assert store.steps() == [20, 30, 40, 50]
    assert store.complete() == [20, 40]
    left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not any(k.startswith("dcp/step-00000010/") for k in left)
    assert "dcp-other/step-00000070/.metadata" in left


def test_dcp_s3_client_choice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert gp.dcp_s3_client("s3fs") == "s3fs"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gp.dcp_s3_client("auto") == "s3fs"
    assert "s3torchconnector is not installed" in capsys.readouterr().out
    arm = gp.DcpArm.__new__(gp.DcpArm)
    arm.target, arm.client = "s3://b/p", "s3torchconnector"
    cmd = arm.command(steps=1, save_every=1, persist_every=0, log=Path("x"), model=())
    assert cmd[cmd.index("--dcp-s3-client") + 1] == "s3torchconnector"


def test_extrapolation_multi_tier_ahead_where_the_store_is_slow() -> None:
    slow = next(s for s in gp.SCALES if s.gpus == 16384 and s.store_gb_s == 25.0)
    assert slow.nodes == 2048 and slow.store_s == pytest.approx(3.164e9 / (25e9 / 2048), rel=0.01)
    r = gp.scale_case(slow, days=4, runs=1)
    assert r["mtbi_s"] == pytest.approx(54 * 86400 / 466)
    assert r["tck"].goodput > r["base"].goodput + 0.02
    assert r["tck"].badput.lost_compute < r["base"].badput.lost_compute
    assert r["base_iv"] >= slow.store_s  # one upload at a time
