#!/usr/bin/env python
"""A training loop driven by tierckpt.CheckpointManager (numpy only: no framework needed).

Fits a linear model by gradient descent; the state (weights and step RNG) is saved every
``--save-every`` steps and persisted every ``--persist-every``; on start the loop resumes from the
newest step every rank can restore. ``--stop-at N`` ends the run early (as a crash would), so a
second run shows the resume. Prints one JSON line per step (step, loss) and a final summary.

    python examples/manager_loop.py --address unix:///tmp/d.sock --job lin --steps 50 --save-every 5
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import tierckpt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=None)
    ap.add_argument("--job", default="manager-loop")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--persist-every", type=int, default=0)
    ap.add_argument("--stop-at", type=int, default=None)
    args = ap.parse_args(argv)

    x = np.random.default_rng(0).normal(size=(64, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0])
    state = {"w": np.zeros(4), "rng": np.zeros(1, np.uint64)}  # rng: the seed of the next minibatch draw
    with tierckpt.CheckpointManager(args.job, address=args.address, policy=args.save_every,
                                    persist_every=args.persist_every) as mgr:
        restored = mgr.restore(state)  # fills state's arrays in place
        start = restored.step + 1 if restored else 1
        for step in range(start, args.steps + 1):
            if step == args.stop_at:
                break
            idx = np.random.default_rng(int(state["rng"][0])).integers(0, len(x), 16)
            err = x[idx] @ state["w"] - y[idx]
            state["w"] -= 0.05 * x[idx].T @ err / len(idx)
            state["rng"][0] += 1
            print(json.dumps({"step": step, "loss": float(np.mean(err ** 2))}), flush=True)
            mgr.save(step, state)
        mgr.wait_until_finished()
        s = mgr.stats
        print(json.dumps({"resumed_from": restored.step if restored else None, "committed": s.committed,
                          "failed": s.failed, "latest": mgr.latest_step()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
