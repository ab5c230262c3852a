"""The CLI's contract on the cases a newcomer hits: `restore --out` into a non-empty directory
(refused, or replaced whole with --force), exit 4 for an unknown job or step on every command that
names one, `ls` bytes of steps held only in the persistent tier after a restart, and `plan`'s
units and `--plot`. Real daemons, the CLI through `cli.main` or as a subprocess."""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
from tierckpt import cli

ARR = np.arange(1000, dtype=np.float32)


def call(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(list(argv), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture()
def saved(daemon):
    with daemon.client() as c:
        c.save("job", 7, 0, 1, {"w": ARR, "b": b"bias"}).result(30)
        c.save("job", 8, 0, 1, {"v": ARR + 1}).result(30)
    return ("--address", daemon.address)


def test_restore_refuses_a_non_empty_out_and_force_replaces_it_whole(saved, tmp_path):
    out = tmp_path / "r"
    assert call(*saved, "restore", "job", "--rank", "0", "--step", "7", "--out", str(out))[0] == 0
    assert sorted(os.listdir(out)) == ["b", "checkpoint.json", "w"]
    (out / "mine.txt").write_text("keep me")
    rc, so, err = call(*saved, "restore", "job", "--rank", "0", "--step", "8", "--out", str(out))
    assert rc == 2 and so == "" and err.strip() == f"tierckpt: error: --out: {out} is not empty (--force replaces " \
                                                  "it whole)"
    assert sorted(os.listdir(out)) == ["b", "checkpoint.json", "mine.txt", "w"]  # untouched
    rc, so, err = call(*saved, "restore", "job", "--rank", "0", "--step", "8", "--out", str(out), "--force")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["checkpoint.json", "v"]  # step 8 only: no shard of step 7 beside it
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 8
    assert np.array_equal(np.fromfile(out / "v", dtype=np.float32), ARR + 1)
    assert sorted(os.listdir(tmp_path)) == ["r"]  # no temporary directory left beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert call(*saved, "restore", "job", "--rank", "0", "--out", str(empty))[0] == 0  # empty: no --force needed
    assert sorted(os.listdir(empty)) == ["checkpoint.json", "v"]


def test_force_restore_that_fails_leaves_the_old_directory(saved, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "old").write_text("x")
    rc, so, err = call(*saved, "restore", "job", "--rank", "0", "--step", "99", "--out", str(out), "--force")
    assert so == "" and "99" in err
    assert rc == 4 and os.listdir(out) == ["old"] and sorted(os.listdir(tmp_path)) == ["r"]


@pytest.mark.parametrize("argv", [
    ["ls", "nojob"], ["ls", "nojob", "--json"], ["latest", "nojob"],
    ["verify", "nojob"], ["verify", "job", "--step", "99"], ["verify", "job", "--step", "99", "--json"],
    ["rm", "nojob", "--step", "1"], ["rm", "job", "--step", "99"], ["rm", "job", "--step", "99", "--tier", "local"],
    ["restore", "nojob", "--rank", "0", "--out", "OUT"], ["restore", "job", "--rank", "0", "--step", "99",
                                                          "--out", "OUT"],
], ids=" ".join)
def test_unknown_job_or_step_exits_4_on_every_command(saved, tmp_path, argv):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    rc, out, err = call(*saved, *argv)
    assert rc == 4, (rc, out, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("tierckpt: error: ")
    assert not (tmp_path / "out").exists()
    assert call(*saved, "ls", "job")[0] == 0  # nothing was removed


def test_ls_shows_persistent_bytes_after_a_restart(daemon_factory, tmp_path):
    store = ("--persistent", f"file://{tmp_path}/bucket")
    first = daemon_factory("n0", args=store)
    with first.client() as c:
        c.save("pj", 3, 0, 2, {"w": ARR}, persist=True).wait("persistent", timeout=60)
        c.save("pj", 3, 1, 2, {"w": ARR[:10], "b": b"12345"}, persist=True).wait("persistent", timeout=60)
    first.kill()
    other = daemon_factory("n1", args=store)  # a fresh node: the step is only in the object store
    rc, out, err = call("--address", other.address, "ls", "pj", "--json")
    assert rc == 0, err
    (ck,) = json.loads(out)["checkpoints"]
    assert ck["complete_in"] == ["persistent"]
    assert {r["rank"]: r["bytes"] for r in ck["ranks"]} == {0: 4000, 1: 45} and ck["bytes"] == 4045
    assert ck["created_unix"] > 0
    rc, out, err = call("--address", other.address, "ls", "pj", "--ranks")
    lines = out.splitlines()
    assert rc == 0 and lines[1].split()[:4] == ["3", "2/2", "yes", "persistent"], out
    assert lines[1].endswith("  4.0 KiB  object store") and lines[2].endswith("  3.9 KiB  object store"), out
    assert lines[3].endswith("  45 B  object store"), out


FULL = "--mtbi 4h --step-time 2 --local-save 0.0004 --local-restore 0.000357 --persistent-save 30"


def test_plan_prints_clean_units():
    rc, out, err = call("plan", *FULL.split())
    assert rc == 0, err
    local = next(line for line in out.splitlines() if line.startswith("local "))
    assert "400 us" in local and "357 us" in local, local
    rc, out, err = call("plan", *"--mtbi 4h --step-time 1 --local-save 0.1 --persistent-save 30".split())
    assert rc == 0 and "100 ms (*)" in out and "30 s (*)" in out and "(*) restore time not given" in out, out


def test_plan_plot_draws_one_curve_per_tier(tmp_path):
    pytest.importorskip("matplotlib", reason="tierckpt[plot] (matplotlib, in the dev extra) is not installed")
    from tierckpt import goodput as gp
    from tierckpt.cli._plot import curves

    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"
    rc, out, err = call("plan", *FULL.split(), "--peer-save", "1", "--plot", str(png))
    assert rc == 0 and "goodput" in out, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert call("plan", *FULL.split(), "--plot", str(svg), "--json")[0] == 0
    text = svg.read_text()
    assert text.startswith("<?xml") and "local interval" in text and "persistent interval" in text
    costs = [gp.TierCost("local", 0.0004, 0.000357), gp.TierCost("persistent", 30, 30)]
    failures = gp.FailureModel(4 * 3600, 0.3, 0.6, 0.1)
    result = gp.plan(costs, failures, 2)
    for name, points in curves(costs, failures, 2, result).items():
        best = max(points, key=lambda p: p[1])
        assert best[1] <= result.goodput + 1e-9, name  # the plan's interval is the top of its curve
        assert len(points) > 10
    rc, _, err = call("plan", *FULL.split(), "--plot", str(tmp_path / "plan.txt"))
    assert rc == 2 and err.startswith("tierckpt: error: --plot:")
    rc, _, err = call("plan", *FULL.split(), "--plot", str(tmp_path / "no" / "plan.png"))
    assert rc == 2 and err.startswith("tierckpt: error: --plot:")


def test_plan_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, out, err = call("plan", *FULL.split(), "--plot", str(tmp_path / "p.png"))
    assert rc == 1 and out == "" and "pip install 'tierckpt[plot]'" in err
