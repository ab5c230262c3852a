"""Load: 8 client processes x 50 saves of mixed sizes against two replicating daemons (each save
waits for its replica); every committed step is restored and compared afterwards."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..harness import Cluster

_SPEC = importlib.util.spec_from_file_location("bench_load", Path(__file__).resolve().parents[2] / "bench" / "load.py")
assert _SPEC is not None and _SPEC.loader is not None
load = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(load)


def test_load_8_clients_x_50_saves_every_step_verified(daemon_factory, matrix) -> None:
    cl = Cluster(daemon_factory, 2, replicas=1, extra=("--keep-local", "60", "--knobs=refresh_interval=0.2"))
    res = load.run_load([cl.d[n].address for n in cl.ids], clients=8, saves=50)
    print(res)
    matrix.record(committed=res["committed"], lost=res["corrupt_or_missing"], typed=len(res["errors"]))
    assert res["errors"] == [] and res["committed"] == 400
    assert res["verified"] == 400 and res["corrupt_or_missing"] == 0
    assert all(d.alive() for d in cl.d.values())
