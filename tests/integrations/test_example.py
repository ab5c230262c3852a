"""examples/manager_loop.py: stopped and restarted, it reproduces the uninterrupted losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LOOP = Path(__file__).resolve().parents[2] / "examples" / "manager_loop.py"


def run(daemon, job: str, *extra: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(LOOP), "--address", daemon.address, "--job", job, "--steps", "20",
                          "--save-every", "5", *extra], capture_output=True, text=True, check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_stop_and_resume_matches_a_straight_run(daemon):
    straight = run(daemon, "loop-ref")
    first = run(daemon, "loop", "--stop-at", "13")
    assert first[-1] == {"resumed_from": None, "committed": 2, "failed": 0, "latest": 10}
    second = run(daemon, "loop")
    assert second[-1]["resumed_from"] == 10 and second[0]["step"] == 11
    ref = {e["step"]: e["loss"] for e in straight if "step" in e}
    assert all(ref[e["step"]] == e["loss"] for e in second if "step" in e)
