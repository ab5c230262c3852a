"""examples/train.py: deterministic resume and save failures that do not stop training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .harness import wait_until

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(path: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events(path):
        if e["event"] == "step":
            out.setdefault(e["step"], []).append(e["loss"])
    return out


def train(address: str, job: str, log: Path, *extra: str, steps: int = 12, wait: bool = True):
    cmd = [sys.executable, str(TRAIN), "--address", address, "--job", job, "--steps", str(steps),
           "--save-every", "3", "--persist-every", "6", "--log-json", str(log), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out = proc.communicate(timeout=60)[0]
    return proc.returncode, out


def test_interrupted_run_reproduces_uninterrupted_losses(daemon, scratch):
    rc, out = train(daemon.address, "whole", scratch / "whole.jsonl")
    assert rc == 0, out
    whole = losses(scratch / "whole.jsonl")
    assert sorted(whole) == list(range(1, 13)) and whole[12][0] < whole[1][0]  # it learns
    assert "step 3 save: blocked" in out and "no checkpoint of whole" in out

    log = scratch / "crash.jsonl"
    rc, out = train(daemon.address, "crash", log, "--stop-after", "7")
    assert rc == 3, out  # crashed after step 7, without waiting for anything
    rc, out = train(daemon.address, "crash", log)
    assert rc == 0, out
    restores = [e for e in events(log) if e["event"] == "restore"]
    assert restores[0]["step"] is None and restores[1]["step"] in (3, 6) and restores[1]["tier"] == "local"
    assert f"restored step {restores[1]['step']} from local tier" in out
    resumed = losses(log)
    # Every step's loss, including steps recomputed after the resume, equals the uninterrupted run's.
    assert sorted(resumed) == list(range(1, 13))
    for step, values in resumed.items():
        assert values == [whole[step][0]] * len(values), step
    saves = [e for e in events(log) if e["event"] == "save"]
    # Step 6 is persisted (--persist-every 6), step 9 is not, in both runs: the resumed run saves
    # step 6 again when it restored step 3 (step 6's commit had not finished before the crash).
    assert {e["persist"] for e in saves if e["step"] == 6} == {True}
    assert {e["persist"] for e in saves if e["step"] == 9} == {False}
    assert all(e["ok"] and e["commit_s"] > 0 for e in events(log) if e["event"] == "commit")

    # Activation checkpointing recomputes blocks with the same RNG state: same losses.
    rc, out = train(daemon.address, "ac", scratch / "ac.jsonl", "--activation-checkpointing", "--save-every", "0")
    assert rc == 0, out
    assert losses(scratch / "ac.jsonl") == whole


def test_daemon_loss_fails_saves_but_not_training_unless_asked(daemon_factory, scratch):
    soft_d, hard_d = daemon_factory("soft"), daemon_factory("hard")
    soft_log, hard_log = scratch / "soft.jsonl", scratch / "hard.jsonl"
    delay = ("--step-delay", "0.05")
    soft = train(soft_d.address, "soft", soft_log, *delay, steps=40, wait=False)
    hard = train(hard_d.address, "hard", hard_log, *delay, "--raise-on-save-error", steps=40, wait=False)
    try:
        for d, log in ((soft_d, soft_log), (hard_d, hard_log)):
            # two trainers start torch on 2 shared cores
            wait_until(lambda: any(e["event"] == "commit" for e in events(log)), 120, "a save committed", 0.05)
            d.kill()
        soft_out = soft.communicate(timeout=60)[0]
        hard_out = hard.communicate(timeout=60)[0]
    finally:
        for p in (soft, hard):
            if p.poll() is None:
                p.kill()
    assert soft.returncode == 0, soft_out
    assert sorted(losses(soft_log)) == list(range(1, 41))  # every step ran
    commits = [e for e in events(soft_log) if e["event"] == "commit"]
    failed = [e for e in commits if not e["ok"]]
    assert commits[0]["ok"] and failed and all("UnavailableError" in e["error"] for e in failed)
    end = next(e for e in events(soft_log) if e["event"] == "end")
    assert end["failed"] == len(failed) and end["committed"] == len(commits) - len(failed)
    assert "failed" in soft_out and "UnavailableError" in soft_out

    assert hard.returncode not in (0, None), hard_out
    assert "UnavailableError" in hard_out and max(losses(hard_log)) < 40
