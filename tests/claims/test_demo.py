"""README, "The two commands": ``make demo`` runs examples/demo.py, three daemons on loopback and
four trainer ranks that crash and resume (local tier), lose a node (rank 1 resumes from its peer
copy) and lose the whole cluster (every rank resumes from the persistent tier), printing per rank
the tier each restore came from. Here the same script runs in its shortened form (``--short``,
24 steps instead of 120) in a scratch directory, and its printed claims are checked. It takes
about a minute, so it is a ``long`` test (``make test-long``, which CI runs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\s*(\d+)\s+(n\d)\s+(fresh start|step (\d+) \((\w+) tier\))\s.*\s(\d+|None)$")


def _phases(out: str) -> dict[str, list[tuple[int, str, str, int | None, str | None, str]]]:
    """The rows of each phase's table: (rank, node, resumed-from text, step, tier, last step)."""
    phases: dict[str, list] = {}
    current = None
    for line in out.splitlines():
        if m := re.match(r"=== phase (\d)", line):
            current = m.group(1)
            phases[current] = []
        elif current and (r := ROW.match(line)):
            step = int(r.group(4)) if r.group(4) else None
            phases[current].append((int(r.group(1)), r.group(2), r.group(3), step, r.group(5), r.group(6)))
    return phases


@pytest.mark.long  # about a minute on a quiet 2-core machine: 16 trainer processes import torch
def test_demo_short_form_survives_every_failure_and_says_where_each_restore_came_from(scratch: Path) -> None:
    state = scratch / "demo"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--short", "--dir", str(state)],
                       capture_output=True, text=True, timeout=900, cwd=scratch)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = p.stdout
    phases = _phases(out)
    assert sorted(phases) == ["1", "2", "3", "4"], out
    for rows in phases.values():
        assert [r[0] for r in rows] == [0, 1, 2, 3], out  # four ranks every phase
        assert [r[1] for r in rows] == ["n0", "n1", "n2", "n0"], out  # rank r on node r % 3
    assert all(r[2] == "fresh start" for r in phases["1"]), out
    assert all(r[4] == "local" and r[3] <= 11 for r in phases["2"]), out  # crashed after step 11
    resumed2 = {r[3] for r in phases["2"]}
    assert len(resumed2) == 1, out  # the ranks agree on one step
    # phase 3: n1 was killed and wiped; rank 1 (on n1) resumes from its peer copy, the others locally
    tiers3 = {r[0]: r[4] for r in phases["3"]}
    assert tiers3 == {0: "local", 1: "peer", 2: "local", 3: "local"}, out
    assert len({r[3] for r in phases["3"]}) == 1 and phases["3"][0][3] <= 17, out
    # phase 4: the whole cluster lost; every rank resumes from the persistent tier (step 16 = 2 x 8)
    assert all(r[4] == "persistent" and r[3] == 16 for r in phases["4"]), out
    assert all(r[5] == "24" for r in phases["4"]), out  # and trains to the end
    assert "done: latest complete step 24" in out, out
    assert re.search(r"^\s*24\s", out, re.M), out  # `tierckpt ls demo` lists step 24
    assert (state / "persistent" / "demo").is_dir()  # the state stays under --dir
    manifests = list((state / "persistent" / "demo" / "manifests").rglob("rank-*.json"))
    assert manifests and all(len(json.loads(m.read_bytes())["mac"]) == 64 for m in manifests)  # every one signed
    assert (state / "logs" / "p4-rank0.jsonl").is_file()
