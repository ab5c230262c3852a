#!/usr/bin/env python
"""What `make demo` runs: a three-node tierckpt cluster on loopback surviving every kind of failure.

Everything lives under ``.demo/`` (no root, no cloud account): three daemons ``n0 n1 n2`` with
peer replication (``--replicas 1``) and the persistent tier on ``file://.demo/persistent``; four
trainer ranks of ``examples/train.py`` spread over them (rank r talks to node r % 3), saving
locally every 10 steps and persistently every 40.

1. Train; the trainers crash (SIGKILL-like exit) after step 55.
2. Restart the trainers: they resume from the latest complete step, from the local tier (the four
   ranks form a gloo process group, as a real job would, and agree on that step before any saves).
3. Kill -9 node n1 and wipe its local dir; start a replacement with the same id and an empty
   dir; the trainers resume — rank 1 (on n1) from its peer copy.
4. Lose the whole cluster (every daemon killed, every local dir wiped); start three fresh
   daemons; the trainers resume from the persistent tier and finish.

Per phase and rank it prints the step and tier each restore came from, the restore time and the
save blocking / commit times.

Options (``make demo`` passes none): ``--dir DIR`` keeps the state under DIR instead of ``.demo/``;
``--short`` runs the same four phases five times shorter (24 steps, saving every 2, persisting
every 8, the crashes after steps 11, 17 and 19): ``tests/claims/test_demo.py`` runs it that way.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / ".demo"
STEPS, SAVE_EVERY, PERSIST_EVERY = 120, 10, 40
CRASH_AFTER = (55, 85, 95)  # phases 1-3; the persisted step phase 4 resumes from is 2 * PERSIST_EVERY
NODES = ("n0", "n1", "n2")
WORLD = 4

from tierckptd.testing import Daemon, free_port  # noqa: E402


def say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


class Cluster:
    def __init__(self) -> None:
        # Unix socket paths are limited to ~107 bytes: keep them short even in a deep checkout.
        self.sock_dir = DEMO if len(str(DEMO)) < 60 else Path(tempfile.mkdtemp(prefix="tck-demo-"))
        self.ports = {n: free_port() for n in NODES}
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in self.ports.items())
        # The cluster's manifest key: every manifest is signed with it (kept beside, never in, the
        # persistent tier; a real cluster distributes it like the certificates).
        key = DEMO / "manifest.key"
        key.write_bytes(secrets.token_hex(32).encode())
        key.chmod(0o600)
        self.daemons = {
            n: Daemon(self.sock_dir, n, port=self.ports[n], log_name=f"{n}.log", args=(
                "--peers", peers, "--replicas", "1", "--keep-local", "2",
                "--persistent", f"file://{DEMO / 'persistent'}", "--persist-every", str(PERSIST_EVERY),
                "--staging-timeout", "30", "--shutdown-timeout", "10", "--manifest-key-file", str(key)))
            for n in NODES
        }
        for d in self.daemons.values():
            d.log_path = DEMO / "logs" / f"{d.node_id}.log"

    def start(self, *nodes: str) -> None:
        for n in nodes or NODES:
            self.daemons[n].start()

    def node_of(self, rank: int) -> Daemon:
        return self.daemons[NODES[rank % len(NODES)]]

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.alive():
                d.terminate(30)


def train(cluster: Cluster, phase: str, stop_after: int = 0) -> list[dict]:
    """Run the four ranks to ``stop_after`` (a simulated crash) or to the end; return stats per rank."""
    procs = []
    rendezvous = f"tcp://127.0.0.1:{free_port()}"  # the ranks' gloo process group: they agree on latest()
    for rank in range(WORLD):
        log = DEMO / "logs" / f"{phase}-rank{rank}.jsonl"
        cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "--address", cluster.node_of(rank).address,
               "--job", "demo", "--rank", str(rank), "--world-size", str(WORLD), "--steps", str(STEPS),
               "--save-every", str(SAVE_EVERY), "--persist-every", str(PERSIST_EVERY), "--log-json", str(log),
               "--log-every", "1000", "--step-delay", "0.01",
               "--dist-init", rendezvous]
        if stop_after:
            cmd += ["--stop-after", str(stop_after)]
        out = open(DEMO / "logs" / f"{phase}-rank{rank}.out", "w")
        procs.append((rank, log, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), out))
    stats = []
    for rank, log, p, out in procs:
        rc = p.wait(600)
        out.close()
        if rc not in (0, 3):
            sys.exit(f"rank {rank} failed (exit {rc}); see {out.name}")
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        restore = next((e for e in events if e.get("event") == "restore" and e.get("step") is not None), None)
        saves = [e["blocking_s"] for e in events if e.get("event") == "save"]
        commits = [e["commit_s"] for e in events if e.get("event") == "commit" and e.get("ok")]
        last = max((e["step"] for e in events if e.get("event") == "step"), default=None)
        stats.append({"rank": rank, "node": cluster.node_of(rank).node_id, "restore": restore, "last_step": last,
                      "saves": len(saves), "blocking_ms": 1000 * statistics.median(saves) if saves else None,
                      "commit_ms": 1000 * statistics.median(commits) if commits else None})
    return stats


def report(phase: str, stats: list[dict]) -> None:
    print(f"{'rank':>4} {'node':>4}  {'resumed from':<26} {'restore':>9}  {'saves':>5} {'save() blocks':>13} "
          f"{'commit':>8}  last step")
    for s in stats:
        r = s["restore"]
        src = f"step {r['step']} ({r['tier']} tier)" if r else "fresh start"
        rt = f"{1000 * r['seconds']:.1f} ms" if r else "-"
        blk = f"{s['blocking_ms']:.2f} ms" if s["blocking_ms"] is not None else "-"
        com = f"{s['commit_ms']:.1f} ms" if s["commit_ms"] is not None else "-"
        print(f"{s['rank']:>4} {s['node']:>4}  {src:<26} {rt:>9}  {s['saves']:>5} {blk:>13} {com:>8}  {s['last_step']}")


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.2)


def persisted(cluster: Cluster, step: int) -> bool:
    import tierckpt

    with tierckpt.Client(cluster.daemons["n0"].address) as c:
        return any(i.step == step and "persistent" in i.tiers for i in c.list("demo"))


def settle(cluster: Cluster) -> None:
    """Wait until the job's complete steps stop changing. A trainer killed just after a save may
    leave its commit in flight at its daemon. The ranks agree on one step through their process
    group whatever lands meanwhile; waiting makes the step they pick the same from run to run."""
    import tierckpt

    seen: list = []
    since = time.monotonic()
    with tierckpt.Client(cluster.daemons["n0"].address) as c:
        while time.monotonic() - since < 1.0:
            now = [(i.step, i.complete) for i in c.list("demo")]
            if now != seen:
                seen, since = now, time.monotonic()
            time.sleep(0.2)


def shown(path: Path) -> Path:
    """``path`` relative to the checkout when it is inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main(argv: list[str] | None = None) -> int:
    global DEMO, STEPS, SAVE_EVERY, PERSIST_EVERY, CRASH_AFTER  # noqa: PLW0603 (the module's settings)
    p = argparse.ArgumentParser(description="a three-node tierckpt cluster on loopback surviving every failure")
    p.add_argument("--dir", type=Path, default=DEMO, help="where the state and logs go (default: .demo/)")
    p.add_argument("--short", action="store_true", help="the same phases, five times fewer steps")
    args = p.parse_args(argv)
    DEMO = args.dir.resolve()
    if args.short:
        STEPS, SAVE_EVERY, PERSIST_EVERY, CRASH_AFTER = 24, 2, 8, (11, 17, 19)
    shutil.rmtree(DEMO, ignore_errors=True)
    (DEMO / "logs").mkdir(parents=True)
    cluster = Cluster()
    try:
        say(f"starting 3 daemons on loopback ({', '.join(f'{n}:{p}' for n, p in cluster.ports.items())}), "
            f"state under {shown(DEMO)}/")
        cluster.start()
        say(f"phase 1: train 4 ranks; they crash after step {CRASH_AFTER[0]}")
        report("1", train(cluster, "p1", stop_after=CRASH_AFTER[0]))
        settle(cluster)

        say("phase 2: restart the trainers; they resume from the local tier")
        report("2", train(cluster, "p2", stop_after=CRASH_AFTER[1]))
        settle(cluster)

        say("phase 3: kill -9 node n1 and wipe its local dir; start a replacement n1 with an empty dir")
        cluster.daemons["n1"].kill()
        cluster.daemons["n1"].wipe()
        cluster.start("n1")
        report("3", train(cluster, "p3", stop_after=CRASH_AFTER[2]))

        kept = 2 * PERSIST_EVERY  # the newest persisted step: the whole cluster resumes from it
        wait_for(lambda: persisted(cluster, kept), f"step {kept} to reach the persistent tier")
        say("phase 4: lose the whole cluster: kill -9 every daemon and wipe every local dir; start 3 fresh daemons")
        for d in cluster.daemons.values():
            d.kill()
            d.wipe()
        cluster.start()
        report("4", train(cluster, "p4"))

        import tierckpt

        with tierckpt.Client(cluster.daemons["n0"].address) as c:
            say(f"done: latest complete step {c.latest('demo')}; tierckpt ls demo:")
        subprocess.run([sys.executable, "-m", "tierckpt.cli", "--address", cluster.daemons["n0"].address,
                        "ls", "demo"], check=True)
        print(f"\nlogs: {shown(DEMO / 'logs')}/  (daemon logs n0.log n1.log n2.log, trainer JSON lines)")
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
