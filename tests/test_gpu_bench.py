"""bench/gpu_save.py (issue 31) works: without a GPU it says so and exits 2; its --cpu-smoke run goes
through every phase (floor, Checkpointer saves, DCP with DefaultStager and tierckpt.dcp.Stager, the
training loop with saves) on the CPU and prints the comparison table. Its figures need a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "gpu_save.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "client"), str(REPO / "daemon"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would measure")
def test_without_a_gpu_it_says_so_and_exits_2():
    r = _run()
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "not run" in r.stderr


def test_cpu_smoke_run_goes_through_every_phase():
    r = _run("--cpu-smoke", "--gib", "0.03", "--tensors", "3", "--runs", "1", "--steps", "4", "--every", "2",
             "--matmuls", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("| tierckpt |", "| dcp DefaultStager |", "| dcp tierckpt.Stager |", "| floor (cudaMemcpy D2H"):
        assert row in r.stdout, r.stdout
    assert "training step:" in r.stdout and "no target is evaluated" in r.stdout
