"""Measured goodput under injected failures: tierckpt (local + peer + persistent) vs DCP to a directory.

Method
------
Both arms train the same deterministic model (``examples/train.py``: TinyLM, AdamW, one-cycle LR,
RNG and data position in the state) for a fixed ``--steps`` N, one rank, while a seeded schedule
of failures is injected. Inter-arrival times are exponential with mean ``--mtbi`` seconds of
wall time since the arm started; each failure's class is drawn with ``--fractions``. Both arms
replay the *same* schedule (same times and classes), so an arm that runs longer meets more
failures, as it would in production. After each failure the trainer is started again (a new
process: python + torch import) and resumes from its newest complete checkpoint.

- crash: SIGKILL the trainer.
- node: tierckpt: SIGKILL the trainer and its node's daemon (n0), wipe n0's local dir, start a
  replacement n0 (same id, empty dir); the trainer resumes from the peer copy. DCP writes straight
  to the persistent directory, so for it a node loss only kills the trainer.
- cluster: tierckpt: SIGKILL the trainer and all three daemons, wipe every local dir, start three
  fresh daemons; the trainer resumes from the persistent tier. DCP: kill the trainer.

Arms:

- tierckpt: three ``tierckptd`` on loopback (``--peers``, ``--replicas 1``, local dirs on tmpfs,
  ``--persistent file://<disk dir>``); ``examples/train.py`` saves through the daemon on n0. Every
  local save is also copied to a peer; ``--save-every`` / ``--persist-every`` are the intervals of
  :func:`tierckpt.goodput.plan` for the measured costs and the injected failure mix.
- DCP: the same training loop (model, data and seed functions imported from examples/train.py) saving
  with ``torch.distributed.checkpoint.save`` (FileSystemWriter, fsync on) into ``step-N.tmp`` on disk,
  renamed to ``step-N`` when complete; the two newest are kept. It resumes from the newest complete
  one. Interval: the planner's persistent-only baseline (Daly) for its measured save cost and the
  MTBI of all failures.

Calibration (before the arms, same model) measures the clean step, the save costs, the restore
from each tier (a crash, a node loss and a cluster loss are each provoked once), the process
restart (spawn to the trainer's first log line; one figure for both arms, it is the same python +
torch import) and the daemon replacement time. A save's *effective* cost is its stall plus the
slow-down of the steps up to the next save: here the daemons' background copies (peer, drain)
share the trainer's two CPU cores, which a GPU node's spare host cores would absorb; the planner
gets the effective costs, and restore costs that include the restart and daemon replacement,
because the measured goodput pays all of them.

Goodput = N x the arm's median step (steps holding a save left out) / wall time from the first
spawn to the trainer's exit. The per-arm median cancels drift in outside load between the arms
(they run one after the other); the plain wall-time ratio is printed too. Wall time is split into
start-up (first spawn to the first step, paid without failures too), process restarts, restores,
save stalls, daemon replacement (tierckpt), lost work (steps redone, plus the partial step or save
at each kill), exit (final commit wait, interpreter exit) and other (steps slower than the median:
background copies, outside load). The planner's goodput for the intervals used
(:func:`tierckpt.goodput.evaluate`) models steady state: compare it with the goodput without
start-up and exit; it is also given at the realized failure rate. Both arms must reach the same
final loss (resumes are exact).

Caveats: the MTBI is scaled down from hours to tens of seconds, so process restarts (about 3 s of
python + torch import each) dominate badput for both arms. The state is small (38 MB; 5 MB with
``--quick``), and DCP writes to a local ext4 disk through the page cache, the best case for DCP:
its save costs about 0.1 s, not the minutes of a large model on remote storage, so the gap the
planner is built for barely exists here. Everything shares two CPU cores with other work, and an
arm meets only 3-5 failures, so whether one more failure lands before an arm finishes swings its
goodput by several points: one run is an illustration, not a measurement of record.

Usage: .venv/bin/python bench/goodput.py [--quick] [--steps 800] [--mtbi 30] [--seed 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierckpt.goodput import FailureModel, TierCost, evaluate, plan

NODES = ("n0", "n1", "n2")
KINDS = ("crash", "node", "cluster")
JOB = "goodput"
MODEL = ("--d-model", "256", "--layers", "4", "--heads", "4", "--seq-len", "32", "--batch-size", "8")
QUICK_MODEL = ("--d-model", "128", "--layers", "2", "--heads", "4", "--seq-len", "32", "--batch-size", "8")


# ---------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Failure:
    at_s: float  # wall seconds since the arm started
    kind: str  # one of KINDS


def failure_schedule(seed: int, mtbi_s: float, fractions: dict[str, float]) -> Iterator[Failure]:
    """An endless seeded Poisson process of failures; the same arguments give the same sequence."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbi_s)
        u, acc, kind = rng.random(), 0.0, KINDS[-1]
        for k in KINDS:
            acc += fractions[k]
            if u < acc:
                kind = k
                break
        yield Failure(t, kind)


# ---------------------------------------------------------------------------------------------- accounting


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by SIGKILL
    return out


@dataclass
class Incarnation:
    """One trainer process: when it was spawned, its JSON log, and how it ended."""

    spawn_t: float
    log: Path
    end_t: float = 0.0
    killed_by: str | None = None  # failure class, or None when it exited by itself
    replacement_s: float = 0.0  # daemon restarts after its failure (tierckpt node/cluster loss)

    def events(self) -> list[dict]:
        return read_events(self.log)


def step_intervals(events: list[dict]) -> list[float]:
    """Seconds between consecutive step events of one process, leaving out those holding a save."""
    saved = {e["step"] for e in events if e["event"] == "save"}
    steps = [e for e in events if e["event"] == "step"]
    return [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["step"] == a["step"] + 1 and a["step"] not in saved]


def account(incs: list[Incarnation], n_steps: int) -> dict[str, Any]:
    """Splits an arm's wall time (first spawn to last exit) into useful work and badput by cause.

    Useful work is ``n_steps`` times the arm's median step (steps holding a save left out).
    """
    wall = incs[-1].end_t - incs[0].spawn_t
    step_s = statistics.median(x for inc in incs for x in step_intervals(inc.events()))
    out: dict[str, Any] = {"wall_s": wall, "useful_s": n_steps * step_s, "startup_s": 0.0, "restart_s": 0.0,
                           "restore_s": 0.0, "save_s": 0.0, "replacement_s": 0.0, "partial_s": 0.0, "exit_s": 0.0, "saves": 0,
                           "executed_steps": 0, "restored_from": {}, "failures": dict.fromkeys(KINDS, 0),
                           "final_loss": None, "step_s": step_s}
    for i, inc in enumerate(incs):
        ev = inc.events()
        start = next((e["t"] for e in ev if e["event"] == "start"), None)
        restore = next((e for e in ev if e["event"] == "restore"), None)
        steps = [e for e in ev if e["event"] == "step"]
        first = steps[0]["t"] if steps else None
        if i == 0:  # start-up: paid once even without failures (spawn to first step, less that step)
            out["startup_s"] += ((first - step_s) if first else inc.end_t) - inc.spawn_t
        elif start is not None:
            out["restart_s"] += start - inc.spawn_t
            if restore is not None:
                out["restore_s"] += restore["t"] - start
        else:
            out["restart_s"] += inc.end_t - inc.spawn_t  # killed before its first line
        if restore is not None and restore.get("step") is not None and i > 0:
            tier = restore.get("tier", "dcp")
            out["restored_from"][tier] = out["restored_from"].get(tier, 0) + 1
        saves = [e for e in ev if e["event"] == "save"]
        out["saves"] += len(saves)
        out["save_s"] += sum(e["blocking_s"] for e in saves)
        out["executed_steps"] += len(steps)
        out["replacement_s"] += inc.replacement_s
        if inc.killed_by:
            out["failures"][inc.killed_by] += 1
            if ev:  # work after the last logged event (a step or save in progress) is lost too
                out["partial_s"] += inc.end_t - ev[-1]["t"]
        elif ev:
            out["exit_s"] += inc.end_t - ev[-1]["t"]  # final waits for commits, interpreter exit
        if steps and steps[-1]["step"] == n_steps:
            out["final_loss"] = steps[-1]["loss"]
    out["recomputed_steps"] = out["executed_steps"] - n_steps
    out["lost_s"] = out["recomputed_steps"] * step_s + out["partial_s"]
    known = sum(out[k] for k in ("useful_s", "startup_s", "restart_s", "restore_s", "save_s", "replacement_s",
                                 "lost_s", "exit_s"))
    out["other_s"] = wall - known
    out["goodput"] = out["useful_s"] / wall
    out["goodput_steady"] = out["useful_s"] / (wall - out["startup_s"] - out["exit_s"])
    return out


# ---------------------------------------------------------------------------------------------- arms


def fstype(path: Path) -> str:
    """The filesystem type holding ``path`` (longest mount point prefix in /proc/mounts)."""
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, typ = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    except OSError:
        pass
    return kind


class TierckptArm:
    """Three daemons on loopback; the trainer (one rank) on n0."""

    name = "tierckpt"

    def __init__(self, work: Path, sock_root: Path, persist_every: int) -> None:
        from tierckptd.testing import Daemon, free_port

        work.mkdir(parents=True, exist_ok=True)
        ports = {n: free_port() for n in NODES}
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
        self.daemons = {n: Daemon(sock_root, n, port=ports[n], args=(
            "--peers", peers, "--replicas", "1", "--keep-local", "2",
            "--persistent", f"file://{work / 'persistent'}", "--persist-every", str(persist_every),
            "--staging-timeout", "30", "--shutdown-timeout", "5")) for n in NODES}
        for d in self.daemons.values():
            d.log_path = work / f"{d.node_id}.log"
            d.start()

    def command(self, steps: int, save_every: int, persist_every: int, log: Path, model: tuple[str, ...],
                stop_after: int = 0) -> list[str]:
        return [sys.executable, str(ROOT / "examples" / "train.py"), "--address", self.daemons["n0"].address,
                "--job", JOB, "--steps", str(steps), "--save-every", str(save_every),
                "--persist-every", str(persist_every), "--log-json", str(log), "--log-every", "100000",
                "--stop-after", str(stop_after), *model]

    def inject(self, kind: str) -> float:
        """Applies a failure to the daemons (the trainer is already dead); returns replacement seconds."""
        if kind == "crash":
            return 0.0
        lost = ["n0"] if kind == "node" else list(NODES)
        t0 = time.monotonic()
        for n in lost:
            self.daemons[n].kill()
            self.daemons[n].wipe()
        for n in lost:
            self.daemons[n].start()
        return time.monotonic() - t0

    def held(self, tier: str) -> bool:
        """Whether the newest complete step (peer), or any step (persistent), is held in ``tier``."""
        import tierckpt

        with tierckpt.Client(self.daemons["n0"].address) as c:
            infos = [i for i in c.list(JOB) if i.complete]
            if tier == "peer":
                infos = [max(infos, key=lambda i: i.step)] if infos else []
            return any(tier in i.tiers for i in infos)

    def close(self) -> None:
        for d in self.daemons.values():
            if d.alive():
                try:
                    d.terminate(15)
                except subprocess.TimeoutExpired:
                    pass


class DcpArm:
    """DCP straight to a directory on disk; nothing to lose but the trainer."""

    name = "dcp"

    def __init__(self, work: Path) -> None:
        self.dir = work / "dcp"
        self.dir.mkdir(parents=True, exist_ok=True)

    def command(self, steps: int, save_every: int, persist_every: int, log: Path, model: tuple[str, ...],
                stop_after: int = 0) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--dcp-worker", "--dcp-dir", str(self.dir),
                "--job", JOB, "--steps", str(steps), "--save-every", str(save_every), "--log-json", str(log),
                "--log-every", "100000", "--stop-after", str(stop_after), *model]

    def inject(self, kind: str) -> float:
        return 0.0

    def close(self) -> None:
        pass


def spawn(cmd: list[str], out: Path) -> subprocess.Popen:
    with open(out, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)


def run_once(arm: Any, logs: Path, name: str, cmd_args: dict, timeout: float = 300) -> Incarnation:
    """One trainer run to its end (exit 0, or 3 from --stop-after)."""
    log = logs / f"{name}.jsonl"
    inc = Incarnation(time.time(), log)
    p = spawn(arm.command(log=log, **cmd_args), logs / f"{name}.out")
    rc = p.wait(timeout)
    inc.end_t = time.time()
    if rc not in (0, 3):
        sys.exit(f"{name}: trainer exited {rc}; see {logs / (name + '.out')}")
    return inc


def run_arm(arm: Any, logs: Path, schedule: Iterator[Failure], cmd_args: dict, timeout: float) -> list[Incarnation]:
    """Trains to the end under the failure schedule; returns every trainer process it took."""
    incs: list[Incarnation] = []
    t0 = time.time()
    nxt = next(schedule)
    while True:
        log = logs / f"{arm.name}-{len(incs)}.jsonl"
        inc = Incarnation(time.time(), log)
        p = spawn(arm.command(log=log, **cmd_args), logs / f"{arm.name}-{len(incs)}.out")
        incs.append(inc)
        try:
            rc = p.wait(max(0.0, t0 + nxt.at_s - time.time()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            inc.end_t = time.time()
            inc.killed_by = nxt.kind
            inc.replacement_s = arm.inject(nxt.kind)
            print(f"  {inc.end_t - t0:6.1f} s  {nxt.kind:<7} (trainer #{len(incs) - 1} killed"
                  + (f"; daemons replaced in {inc.replacement_s:.1f} s)" if inc.replacement_s else ")"), flush=True)
            nxt = next(schedule)
            if time.time() - t0 > timeout:
                sys.exit(f"{arm.name}: no finish within {timeout:.0f} s")
            continue
        inc.end_t = time.time()
        if rc != 0:
            sys.exit(f"{arm.name}: trainer exited {rc}; see {logs / (arm.name + '-' + str(len(incs) - 1) + '.out')}")
        return incs


# ---------------------------------------------------------------------------------------------- calibration


def wait_until(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            sys.exit(f"calibration: timed out waiting for {what}")
        time.sleep(0.2)


def restore_cost(inc: Incarnation) -> tuple[float, float, str | None]:
    """(restart s, restore s, tier) of a resumed run."""
    ev = inc.events()
    start = next(e["t"] for e in ev if e["event"] == "start")
    restore = next(e for e in ev if e["event"] == "restore")
    return start - inc.spawn_t, restore["t"] - start, restore.get("tier", "dcp")


def save_costs(incs: list[Incarnation]) -> dict[str, float]:
    """Median save stall and effective save cost, for saves with and without ``persist``.

    A save's effective cost is the time it adds to the run: its stall plus the slow-down of the
    steps up to the next save (the daemons' background copies share the trainer's CPUs here),
    measured against the run's median step and floored at the stall.
    """
    out: dict[str, list[float]] = {}
    for inc in incs:
        ev = inc.events()
        ref = statistics.median(step_intervals(ev))
        saves = {e["step"]: e for e in ev if e["event"] == "save"}
        at = {e["step"]: e["t"] for e in ev if e["event"] == "step"}
        for s, e in saves.items():
            nxt = min((k for k in saves if k > s), default=s + 5)
            if nxt not in at:
                continue  # the run stopped before the next save: window incomplete
            extra = at[nxt] - at[s] - (nxt - s) * ref
            kind = "persist" if e["persist"] else "local"
            out.setdefault(f"{kind}_stall_s", []).append(e["blocking_s"])
            out.setdefault(f"{kind}_cost_s", []).append(max(e["blocking_s"], extra))
    return {k: statistics.median(v) for k, v in out.items()}


def calibrate_dcp(work: Path, logs: Path, model: tuple[str, ...], steps: int) -> dict[str, Any]:
    arm = DcpArm(work / "calib")
    a = {"steps": steps, "save_every": 5, "persist_every": 0, "model": model}
    first = run_once(arm, logs, "calib-dcp-0", {**a, "stop_after": steps - 28})
    resumed = run_once(arm, logs, "calib-dcp-1", {**a, "stop_after": steps - 23})
    restart, restore, _ = restore_cost(resumed)
    shutil.rmtree(arm.dir, ignore_errors=True)
    return {"step_s": statistics.median(step_intervals(first.events())), **save_costs([first]),
            "restore_s": restore, "restarts_s": [restart]}


def calibrate_tierckpt(work: Path, sock: Path, logs: Path, model: tuple[str, ...], steps: int) -> dict[str, Any]:
    """Provokes a crash, a node loss and a cluster loss once each; measures every tier's restore."""
    arm = TierckptArm(work / "calib", sock / "calib", persist_every=10)
    try:
        a = {"steps": steps, "save_every": 5, "persist_every": 10, "model": model}
        stops = [steps - 28, steps - 23, steps - 18, steps - 13]
        first = run_once(arm, logs, "calib-tck-0", {**a, "stop_after": stops[0]})
        crash = run_once(arm, logs, "calib-tck-1", {**a, "stop_after": stops[1]})
        wait_until(lambda: arm.held("peer"), "a peer copy of the newest step")
        repl_node = arm.inject("node")
        node = run_once(arm, logs, "calib-tck-2", {**a, "stop_after": stops[2]})
        wait_until(lambda: arm.held("persistent"), "a persistent copy")
        repl_cluster = arm.inject("cluster")
        cluster = run_once(arm, logs, "calib-tck-3", {**a, "stop_after": stops[3]})
    finally:
        arm.close()
    out: dict[str, Any] = {"node_replacement_s": repl_node, "cluster_replacement_s": repl_cluster}
    restarts = []
    for inc, want in ((crash, "local"), (node, "peer"), (cluster, "persistent")):
        restart, restore, tier = restore_cost(inc)
        if tier != want:
            print(f"  note: calibration {want} restore came from the {tier} tier")
        out[f"{want}_restore_s"] = restore
        restarts.append(restart)
    out["restarts_s"] = restarts
    out.update(save_costs([first, crash, node, cluster]))
    out["step_s"] = statistics.median(step_intervals(first.events()))
    return out


# ---------------------------------------------------------------------------------------------- DCP trainer


def dcp_worker(argv: list[str]) -> int:
    """The training loop of examples/train.py, checkpointing with DCP into --dcp-dir."""
    import importlib.util
    import warnings

    ap = argparse.ArgumentParser()
    ap.add_argument("--dcp-worker", action="store_true")
    ap.add_argument("--dcp-dir", required=True)
    own, rest = ap.parse_known_args(argv)
    spec = importlib.util.spec_from_file_location("tck_train", ROOT / "examples" / "train.py")
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)  # type: ignore[union-attr]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    args = tr.parse_args(rest)
    jlog = tr.JsonLog(args.log_json)
    jlog("start", job=args.job, rank=args.rank, world_size=args.world_size, pid=os.getpid())
    model, opt, sched, data = tr.build(args)
    extra = {"tokens_seen": 0}
    root = Path(own.dcp_dir)

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "sched": sched.state_dict(), "rng": tr.RNGState().state_dict(),
                "data": data.state_dict(), "extra": dict(extra)}

    done = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit() and (p / ".metadata").exists())
    start = 0
    if done:
        t0 = time.perf_counter()
        sd = state()
        dcp.load(sd, checkpoint_id=root / f"step-{done[-1]:08d}")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        tr.RNGState().load_state_dict(sd["rng"])
        data.load_state_dict(sd["data"])
        extra.update(sd["extra"])
        start = done[-1]
        jlog("restore", step=start, tier="dcp", seconds=time.perf_counter() - t0)
    else:
        jlog("restore", step=None)
    model.train()
    for step in range(start + 1, args.steps + 1):
        loss, tokens = tr.train_step(model, opt, sched, data, args.vocab)
        extra["tokens_seen"] += tokens
        jlog("step", step=step, loss=loss.item(), lr=sched.get_last_lr()[0])
        if args.save_every and step % args.save_every == 0:
            t0 = time.perf_counter()
            tmp, final = root / f"step-{step:08d}.tmp", root / f"step-{step:08d}"
            shutil.rmtree(tmp, ignore_errors=True)
            dcp.save(state(), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
            os.replace(tmp, final)  # complete: only now visible to a resume
            fd = os.open(root, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            for old in sorted(p for p in root.glob("step-*") if p.name[5:].isdigit())[:-2]:
                shutil.rmtree(old, ignore_errors=True)
            jlog("save", step=step, persist=True, blocking_s=time.perf_counter() - t0)
        if args.stop_after and step >= args.stop_after:
            os._exit(3)
        if args.step_delay:
            time.sleep(args.step_delay)
    jlog("end")
    return 0


# ---------------------------------------------------------------------------------------------- main


def parse_fractions(text: str) -> dict[str, float]:
    vals = [float(v) for v in text.split(",")]
    if len(vals) != 3 or abs(sum(vals) - 1) > 1e-6 or min(vals) < 0:
        raise argparse.ArgumentTypeError("--fractions: three shares crash,node,cluster summing to 1")
    return dict(zip(KINDS, vals))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--dcp-worker" in argv:
        return dcp_worker(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default 800; quick 500)")
    ap.add_argument("--mtbi", type=float, default=None, help="mean seconds between failures (default 30; quick 10)")
    ap.add_argument("--fractions", type=parse_fractions, default=parse_fractions("0.6,0.3,0.1"),
                    help="shares of crash,node,cluster failures (default 0.6,0.3,0.1)")
    ap.add_argument("--seed", type=int, default=1, help="failure schedule seed")
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller model, fewer steps, MTBI 10 s")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs (logs) and print where")
    args = ap.parse_args(argv)
    steps = args.steps or (500 if args.quick else 800)
    mtbi = args.mtbi or (10.0 if args.quick else 30.0)
    model = QUICK_MODEL if args.quick else MODEL
    fr = args.fractions
    failures = FailureModel(mtbi, fr["crash"], fr["node"], fr["cluster"])

    from tierckptd.testing import scratch_dir

    work = Path(tempfile.mkdtemp(prefix="tck-goodput-"))  # persistent tier and DCP: disk, not tmpfs
    sock = scratch_dir("tck-gp-")  # daemons' local dirs (tmpfs) and sockets
    logs = work / "logs"
    logs.mkdir()
    print(f"model {' '.join(model)}; {steps} steps per arm; MTBI {mtbi:g} s (crash {fr['crash']:.0%}, "
          f"node {fr['node']:.0%}, cluster {fr['cluster']:.0%}); seed {args.seed}")
    print(f"DCP dir and persistent tier on {fstype(work)} ({work}); local tier on {fstype(sock)} ({sock})")
    try:
        print("calibrating (clean steps, save stalls, a crash, a node loss and a cluster loss) ...", flush=True)
        cal_steps = 60 if args.quick else 80
        cd = calibrate_dcp(work, logs, model, cal_steps)
        ct = calibrate_tierckpt(work, sock, logs, model, cal_steps)
        step_s = cd["step_s"]  # plans are made before the arms run, from the calibration
        # The same process restart (python + torch import) in both arms: one figure from all samples.
        restart = statistics.median(ct["restarts_s"] + cd["restarts_s"])
        r = {k: restart + ct[f"{k}_restore_s"] for k in ("local", "peer", "persistent")}
        r["peer"] += ct["node_replacement_s"]
        r["persistent"] += ct["cluster_replacement_s"]
        # Every local save is also copied to a peer: local and peer cost the same (effective, see
        # save_costs); a persist save adds the drain.
        save_cost = ct["local_cost_s"]
        costs = [TierCost("local", save_cost, r["local"]), TierCost("peer", save_cost, r["peer"]),
                 TierCost("persistent", max(save_cost, ct["persist_cost_s"]), r["persistent"])]
        tplan = plan(costs, failures, step_s)
        iv = tplan.intervals_steps
        save_every = min(s for s in iv.values() if s)
        persist_every = iv["persistent"] or 0
        dcp_costs = [TierCost("persistent", cd["persist_cost_s"], restart + cd["restore_s"])]
        dplan = plan(dcp_costs, failures, step_s)
        dcp_every = dplan.baseline_interval_steps
        print(f"clean step {step_s * 1e3:.1f} ms; save stall / effective cost: tierckpt local+peer "
              f"{ct['local_stall_s'] * 1e3:.0f} / {save_cost * 1e3:.0f} ms, +persistent "
              f"{ct['persist_stall_s'] * 1e3:.0f} / {ct['persist_cost_s'] * 1e3:.0f} ms, DCP "
              f"{cd['persist_stall_s'] * 1e3:.0f} / {cd['persist_cost_s'] * 1e3:.0f} ms")
        print(f"process restart {restart:.2f} s (median of {len(ct['restarts_s']) + 1}); restore after it: "
              f"local {ct['local_restore_s'] * 1e3:.0f} ms, peer {ct['peer_restore_s'] * 1e3:.0f} ms, persistent "
              f"{ct['persistent_restore_s'] * 1e3:.0f} ms, DCP {cd['restore_s'] * 1e3:.0f} ms; daemon replacement: "
              f"node {ct['node_replacement_s']:.2f} s, cluster {ct['cluster_replacement_s']:.2f} s")
        print(f"planner: tierckpt local/peer/persistent every {iv['local']}/{iv['peer']}/{iv['persistent']} steps "
              f"(--save-every {save_every} --persist-every {persist_every}); DCP every {dcp_every} steps")

        incs = {}
        for name in ("tierckpt", "dcp"):
            print(f"arm {name}:", flush=True)
            if name == "tierckpt":
                arm: Any = TierckptArm(work / name, sock / name, persist_every)
                cmd = {"steps": steps, "save_every": save_every, "persist_every": persist_every, "model": model}
            else:
                arm = DcpArm(work / name)
                cmd = {"steps": steps, "save_every": dcp_every, "persist_every": 0, "model": model}
            try:
                incs[name] = run_arm(arm, logs, failure_schedule(args.seed, mtbi, fr), cmd,
                                     timeout=20 * steps * step_s + 300)
            finally:
                arm.close()
        # Useful step time: each arm's own median step (no save in it), which cancels drift in the
        # outside load between the arms; the wall-time ratio is printed too.
        results = {name: account(incs[name], steps) for name in incs}
        schedules = {"tierckpt": (costs, {t: (n * step_s if n else None) for t, n in iv.items()}),
                     "dcp": (dcp_costs, {"persistent": dcp_every * step_s})}
        for name, (c, ivs) in schedules.items():
            res = results[name]
            res["predicted"] = evaluate(c, failures, ivs, step_s).goodput
            n = sum(res["failures"].values())
            real = FailureModel((res["wall_s"] - res["startup_s"] - res["exit_s"]) / n, fr["crash"], fr["node"], fr["cluster"]) \
                if n else None
            res["predicted_realized"] = evaluate(c, real, ivs, step_s).goodput if real else None
        report(results, steps, step_s)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "steps": steps, "mtbi_s": mtbi, "fractions": fr, "seed": args.seed, "model": list(model),
                "calibration": {"tierckpt": ct, "dcp": cd}, "plan": tplan.to_dict(), "dcp_plan": dplan.to_dict(),
                "intervals_steps": {"save_every": save_every, "persist_every": persist_every, "dcp_every": dcp_every},
                "calibration_step_s": step_s,
                "arms": results}, indent=2))
    finally:
        if args.keep:
            print(f"work dir kept: {work} (logs/), {sock}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(sock, ignore_errors=True)
    return 0


def report(results: dict[str, dict], steps: int, calibration_step_s: float) -> None:
    t, d = results["tierckpt"], results["dcp"]
    print(f"\n{steps} steps per arm; useful work = {steps} x the arm's median step "
          f"(calibration: {calibration_step_s * 1e3:.1f} ms)")
    rows = [("failures crash/node/cluster", lambda a: "/".join(str(a["failures"][k]) for k in KINDS)),
            ("restored from", lambda a: ", ".join(f"{k} {v}" for k, v in sorted(a["restored_from"].items())) or "-"),
            ("median step", lambda a: f"{a['step_s'] * 1e3:.1f} ms"),
            ("useful work", lambda a: f"{a['useful_s']:.1f} s"),
            ("wall time", lambda a: f"{a['wall_s']:.1f} s"),
            ("  start-up (once)", lambda a: f"{a['startup_s']:.1f} s"),
            ("  process restarts", lambda a: f"{a['restart_s']:.1f} s"),
            ("  restores", lambda a: f"{a['restore_s']:.2f} s"),
            ("  save stalls", lambda a: f"{a['save_s']:.2f} s ({a['saves']} saves)"),
            ("  daemon replacement", lambda a: f"{a['replacement_s']:.1f} s"),
            ("  lost work", lambda a: f"{a['lost_s']:.1f} s ({a['recomputed_steps']} steps redone)"),
            ("  exit (last commit)", lambda a: f"{a['exit_s']:.1f} s"),
            ("  other (slow steps)", lambda a: f"{a['other_s']:.1f} s"),
            ("goodput", lambda a: f"{a['goodput']:.1%}"),
            ("  without start-up, exit", lambda a: f"{a['goodput_steady']:.1%}"),
            ("planner's prediction", lambda a: f"{a['predicted']:.1%}"),
            ("  at the realized MTBI", lambda a: "-" if a["predicted_realized"] is None
             else f"{a['predicted_realized']:.1%}"),
            ("final loss", lambda a: f"{a['final_loss']:.6f}" if a["final_loss"] is not None else "-")]
    print(f"{'':<28} {'tierckpt':>22} {'DCP':>22}")
    for label, fn in rows:
        print(f"{label:<28} {fn(t):>22} {fn(d):>22}")
    print(f"goodput ratio tierckpt/DCP: {t['goodput'] / d['goodput']:.2f}x "
          f"(without start-up and exit {t['goodput_steady'] / d['goodput_steady']:.2f}x; "
          f"wall-time ratio DCP/tierckpt {d['wall_s'] / t['wall_s']:.2f}x; "
          f"predicted {t['predicted'] / d['predicted']:.2f}x)")
    if t["final_loss"] != d["final_loss"]:
        print("WARNING: the arms' final losses differ: a resume was not exact")


if __name__ == "__main__":
    sys.exit(main())
