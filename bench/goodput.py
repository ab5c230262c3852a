"""Measured goodput under injected failures: tierckpt (local + peer + persistent) vs DCP (a directory or S3).

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

``--s3``: the regime the product is for. 512 MiB of state per rank (``LARGE_MODEL``: one 44.7 M
parameter tied embedding/head, weights + two AdamW moments, batch 1 x 16 tokens so that a step
stays cheap on a CPU core). The only durable storage is S3: a ``moto_server`` reached through
``bench/_throttle.py``, a token-bucket TCP proxy (``--s3-rate`` MiB/s per direction, default 64:
the state in 8 s) standing for one node's share of object-store bandwidth; ``AWS_ENDPOINT_URL``
points every client at the proxy. tierckpt: ``--persistent s3://...``, ``--keep-persistent 2``.
DCP at PyTorch's best practice: ``dcp.async_save`` with fsspec/s3fs (``FsspecWriter``, two
upload threads, 32 MiB parts) to the same server through the same limit; a save first waits for
the previous upload (one in flight); ``.metadata``, written last by DCP, marks a complete step; a
resume runs ``dcp.load`` (``FsspecReader``) from the newest one; the two newest are kept. Its
interval is the planner's persistent-only (Daly) baseline for its measured effective save cost.
The simulator (:func:`tierckpt.goodput.simulate`) is run on the same calibrated inputs, with
the upload time measured on the DCP arm as the persistent lag of both arms, and on a sweep of
DCP intervals; ``--sweep F,...`` runs the DCP arm again at those multiples of its interval.

``--extrapolate``: no benchmark, only the simulator at 1,024 and 16,384 GPUs with Llama 3's
interruption rate (see ``SCALES`` and bench/README.md).

Usage: .venv/bin/python bench/goodput.py [--quick | --s3 [--s3-rate 64] [--sweep 0.5,2]] [--steps 800]
       [--mtbi 30] [--seed 1] [--json FILE]
       .venv/bin/python bench/goodput.py --extrapolate
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierckpt.goodput import FailureModel, TierCost, evaluate, plan, simulate  # noqa: E402

NODES = ("n0", "n1", "n2")
KINDS = ("crash", "node", "cluster")
JOB = "goodput"
SIM_RUNS = 400  # runs of the simulator per prediction: its expectation, not one draw
PEER_LAG_S = 1.0  # replication of the state to a peer on loopback (bench/replication.py: ~0.2-0.5 s/GiB)
MODEL = ("--d-model", "256", "--layers", "4", "--heads", "4", "--seq-len", "32", "--batch-size", "8")
# ~44.7 M parameters (one tied embedding/head, no blocks): weights + two AdamW moments = 512 MiB,
# with a step cheap enough for one CPU core (batch 1 x 16 tokens).
LARGE_MODEL = ("--vocab", "43690", "--d-model", "1024", "--layers", "0", "--heads", "4", "--seq-len", "16",
               "--batch-size", "1")
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
    return [b["t"] - a["t"] for a, b in itertools.pairwise(steps)
            if b["step"] == a["step"] + 1 and a["step"] not in saved]


def account(incs: list[Incarnation], n_steps: int) -> dict[str, Any]:
    """Splits an arm's wall time (first spawn to last exit) into useful work and badput by cause.

    Useful work is ``n_steps`` times the arm's median step (steps holding a save left out).
    """
    wall = incs[-1].end_t - incs[0].spawn_t
    step_s = statistics.median(x for inc in incs for x in step_intervals(inc.events()))
    out: dict[str, Any] = {"wall_s": wall, "useful_s": n_steps * step_s, "startup_s": 0.0, "restart_s": 0.0,
                           "restore_s": 0.0, "save_s": 0.0, "replacement_s": 0.0, "partial_s": 0.0, "exit_s": 0.0,
                           "saves": 0,
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


BUCKET = "goodput"
S3FS_PATH = Path(os.environ.get("TIERCKPT_BENCH_S3FS", Path(sys.executable).parents[1] / "bench-s3fs"))
"""Where s3fs and its aiobotocore live for the DCP worker (see bench/README.md: they pin a botocore
older than the daemon's boto3 wants, so they are installed apart and put on the worker's path only)."""


def _pythonpath(*extra: Path) -> str:
    return os.pathsep.join([*map(str, extra), *filter(None, [os.environ.get("PYTHONPATH")])])


class ObjectStore:
    """moto_server (S3) on loopback, reached through bench/_throttle.py at ``rate`` bytes/s per direction."""

    def __init__(self, work: Path, rate: float, dcp_client: str = "s3torchconnector") -> None:
        from tierckptd.testing import free_port

        self.dcp_client = dcp_client  # the DCP arm's S3 storage (DCP_S3_CLIENTS)
        port = free_port()
        self.direct = f"http://127.0.0.1:{port}"
        self._log = open(work / "moto.log", "ab")  # closed in close()
        self._procs = [subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                                         "-p", str(port)], stdout=self._log, stderr=subprocess.STDOUT)]
        wait_until(self._up, "moto_server", timeout=30)
        self._admin().create_bucket(Bucket=BUCKET)
        thr = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_throttle.py"), "--target",
                                f"127.0.0.1:{port}", "--rate", str(rate)], stdout=subprocess.PIPE, text=True)
        self._procs.append(thr)
        line = thr.stdout.readline() if thr.stdout else ""
        if not line.startswith("listening "):
            sys.exit("bench/_throttle.py did not start")
        self.rate = rate
        self.env = {"AWS_ENDPOINT_URL": "http://" + line.split()[1], "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def _up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.direct + "/moto-api/", timeout=2):
                return True
        except OSError:
            return False

    def _admin(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.direct, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def delete_prefix(self, url: str) -> None:
        """Deletes every object under ``url`` (admin path: straight to moto, not through the limit)."""
        if not self.alive():
            sys.exit("moto_server or the throttle died (see moto.log; moto keeps objects in memory: the OOM "
                     "killer?): the persistent tier is gone, the run is void")
        prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
        s3 = self._admin()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})

    def close(self) -> None:
        for p in reversed(self._procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._log.close()


class TierckptArm:
    """Three daemons on loopback; the trainer (one rank) on n0."""

    name = "tierckpt"

    def __init__(self, work: Path, sock_root: Path, persist_every: int, store: ObjectStore | None = None) -> None:
        from tierckptd.testing import Daemon, free_port

        work.mkdir(parents=True, exist_ok=True)
        ports = {n: free_port() for n in NODES}
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
        self.env = store.env if store else None
        url = store.url(f"tck-{work.name}") if store else f"file://{work / 'persistent'}"
        keep = "1" if store else "2"  # 512 MiB steps: one per node in RAM (tmpfs) is enough here
        self.daemons = {n: Daemon(sock_root, n, port=ports[n], env=self.env, args=(
            "--peers", peers, "--replicas", "1", "--keep-local", keep, "--keep-persistent", "2",
            "--persistent", url, "--persist-every", str(persist_every),
            "--staging-timeout", "60", "--shutdown-timeout", "5")) for n in NODES}
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
    """DCP straight to the persistent store (a directory on disk, or S3 with async_save); nothing
    to lose but the trainer."""

    name = "dcp"

    def __init__(self, work: Path, store: ObjectStore | None = None) -> None:
        self.dir = work / "dcp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.target = store.url(f"dcp-{work.name}") if store else str(self.dir)
        self.client = store.dcp_client if store else ""
        # s3fs's botocore is older than the daemon's boto3 wants: on the worker's path in that case only
        self.env = {**store.env, **({"PYTHONPATH": _pythonpath(S3FS_PATH)} if self.client == "s3fs" else {})} \
            if store else None

    def clear(self) -> None:
        if self.store:
            self.store.delete_prefix(self.target)
        shutil.rmtree(self.dir, ignore_errors=True)

    def command(self, steps: int, save_every: int, persist_every: int, log: Path, model: tuple[str, ...],
                stop_after: int = 0) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--dcp-worker", "--dcp-dir", self.target,
                *(("--dcp-s3-client", self.client) if self.client else ()), "--job", JOB, "--steps", str(steps),
                "--save-every", str(save_every), "--log-json", str(log),
                "--log-every", "100000", "--stop-after", str(stop_after), *model]

    def inject(self, kind: str) -> float:
        return 0.0

    def close(self) -> None:
        pass


def spawn(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(out, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def run_once(arm: Any, logs: Path, name: str, cmd_args: dict, timeout: float = 300) -> Incarnation:
    """One trainer run to its end (exit 0, or 3 from --stop-after)."""
    log = logs / f"{name}.jsonl"
    inc = Incarnation(time.time(), log)
    p = spawn(arm.command(log=log, **cmd_args), logs / f"{name}.out", arm.env)
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
        p = spawn(arm.command(log=log, **cmd_args), logs / f"{arm.name}-{len(incs)}.out", arm.env)
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


def calibrate_dcp(work: Path, logs: Path, model: tuple[str, ...], steps: int, every: int = 5,
                  store: ObjectStore | None = None) -> dict[str, Any]:
    arm = DcpArm(work / "calib", store)
    a = {"steps": steps, "save_every": every, "persist_every": 0, "model": model}
    first = run_once(arm, logs, "calib-dcp-0", {**a, "stop_after": steps - 28})
    resumed = run_once(arm, logs, "calib-dcp-1", {**a, "stop_after": steps - 23})
    restart, restore, _ = restore_cost(resumed)
    arm.clear()
    ev = first.events()
    saved = {e["step"]: e["t"] for e in ev if e["event"] == "save"}
    uploads = [e["t"] - saved[e["step"]] for e in ev if e["event"] == "persisted" and e["step"] in saved]
    return {"step_s": statistics.median(step_intervals(ev)), **save_costs([first]),
            "restore_s": restore, "restarts_s": [restart],
            "upload_s": statistics.median(uploads) if uploads else 0.0}


def calibrate_tierckpt(work: Path, sock: Path, logs: Path, model: tuple[str, ...], steps: int,
                       persist_every: int = 10, store: ObjectStore | None = None) -> dict[str, Any]:
    """Provokes a crash, a node loss and a cluster loss once each; measures every tier's restore."""
    arm = TierckptArm(work / "calib", sock / "calib", persist_every=persist_every, store=store)
    try:
        a = {"steps": steps, "save_every": 5, "persist_every": persist_every, "model": model}
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


# s3fs tuned for large sequential transfers: 32 MiB parts and reads (default 50 MiB / 5 MiB),
# read-ahead caching; DCP's reader otherwise pays a round trip per 5 MiB.
_S3FS_OPTIONS: dict[str, Any] = {"endpoint_url": os.environ.get("AWS_ENDPOINT_URL"),
                                 "default_block_size": 32 * 2**20, "default_cache_type": "readahead"}
DCP_S3_CLIENTS = ("s3torchconnector", "s3fs")
"""The DCP arm's S3 storage: s3torchconnector's DCP ``S3StorageWriter`` / ``S3StorageReader`` (AWS's
CRT client; the best available) or DCP's ``FsspecWriter`` / ``FsspecReader`` on s3fs (the fallback)."""


def dcp_s3_client(choice: str) -> str:
    """``auto``: s3torchconnector where it is installed, else s3fs (said on stdout)."""
    import importlib.util

    if choice != "auto":
        return choice
    if importlib.util.find_spec("s3torchconnector") is not None:
        return "s3torchconnector"
    print("note: s3torchconnector is not installed (the bench extra): the DCP arm uses s3fs")
    return "s3fs"


def _s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    # moto_server on 127.0.0.1: path-style requests (the CRT client finds the endpoint in AWS_ENDPOINT_URL)
    return S3ClientConfig(force_path_style=True)


class DcpStore:
    """Where the DCP worker keeps ``step-N`` checkpoints: a directory (``dcp.save``, fsync, then a
    rename) or an S3 prefix (``dcp.async_save`` through s3torchconnector or fsspec/s3fs, see
    ``DCP_S3_CLIENTS``; DCP writes ``.metadata`` last, so a step is complete once that object
    exists). With s3torchconnector, listing and pruning (not the data path) go through boto3."""

    def __init__(self, target: str, s3_client: str = "s3torchconnector") -> None:
        self.s3 = target.startswith("s3://")
        self.target = target.rstrip("/")
        self.client = s3_client if self.s3 else ""
        if self.client == "s3fs":
            import s3fs

            self.fs = s3fs.S3FileSystem(use_listings_cache=False, **_S3FS_OPTIONS)
        elif self.client:
            import boto3

            self.bucket, _, self.key = self.target.removeprefix("s3://").partition("/")
            self.boto = boto3.client("s3")  # endpoint, region and credentials from the environment

    def path(self, step: int) -> str:
        return f"{self.target}/step-{step:08d}"

    def _names(self) -> list[str]:
        if self.client == "s3fs":
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.target, refresh=True)] \
                if self.fs.exists(self.target) else []
        if self.client:
            pages = self.boto.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key + "/",
                                                                        Delimiter="/")
            return [p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for page in pages
                    for p in page.get("CommonPrefixes", [])]
        return [p.name for p in Path(self.target).glob("step-*")]

    def steps(self) -> list[int]:
        """Every step with a directory or prefix, complete or not, oldest first."""
        return sorted(int(n[5:]) for n in self._names() if n[5:].isdigit())

    def _has_metadata(self, step: int) -> bool:
        if self.client == "s3fs":
            return bool(self.fs.exists(f"{self.path(step)}/.metadata"))
        if self.client:
            got = self.boto.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.key}/step-{step:08d}/.metadata")
            return bool(got.get("KeyCount"))
        return (Path(self.path(step)) / ".metadata").exists()

    def complete(self) -> list[int]:
        return [s for s in self.steps() if self._has_metadata(s)]

    def _remove(self, step: int) -> None:
        if self.client == "s3fs":
            self.fs.rm(self.path(step), recursive=True)
        elif self.client:
            pages = self.boto.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                        Prefix=f"{self.key}/step-{step:08d}/")
            keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
            if keys:
                self.boto.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
        else:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def prune(self, keep: int = 2) -> None:
        """Removes all but the ``keep`` newest complete steps (and incomplete steps older than them)."""
        done = self.complete()
        for s in self.steps():
            if done[-keep:] and s < done[-keep:][0]:
                self._remove(s)

    def save(self, state: dict, step: int) -> Any:
        """Saves ``state``; returns the async_save future (S3) or None once written (directory)."""
        import torch.distributed.checkpoint as dcp

        if self.s3:
            if self.client == "s3fs":
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                writer: Any = FsspecWriter(self.path(step), sync_files=False, thread_count=2, **_S3FS_OPTIONS)
            else:
                from s3torchconnector.dcp import S3StorageWriter

                writer = S3StorageWriter(_region(), self.path(step), s3client_config=_s3tc_config(), thread_count=2)
            return dcp.async_save(state, storage_writer=writer, no_dist=True)
        tmp, final = Path(self.path(step) + ".tmp"), Path(self.path(step))
        shutil.rmtree(tmp, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        os.replace(tmp, final)  # complete: only now visible to a resume
        fd = os.open(self.target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        self.prune()
        return None

    def load(self, state: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.client == "s3fs":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(state, storage_reader=FsspecReader(self.path(step), **_S3FS_OPTIONS), no_dist=True)
        elif self.client:
            from s3torchconnector.dcp import S3StorageReader

            dcp.load(state, storage_reader=S3StorageReader(_region(), self.path(step), s3client_config=_s3tc_config()),
                     no_dist=True)
        else:
            dcp.load(state, checkpoint_id=self.path(step))


def _region() -> str:
    return os.environ.get("AWS_DEFAULT_REGION", "us-east-1")


def _load_train_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tck_train", ROOT / "examples" / "train.py")
    tr = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(tr)  # type: ignore[union-attr]
    return tr


def _dcp_resume(store: DcpStore, state: Callable[[], dict], apply: Callable[[dict], object],
                jlog: Callable[..., None]) -> int:
    """Loads the newest complete step into a fresh state dict and applies it; returns the step (0: none)."""
    done = store.complete()
    if not done:
        jlog("restore", step=None)
        return 0
    t0 = time.perf_counter()
    sd = state()
    store.load(sd, done[-1])
    apply(sd)
    jlog("restore", step=done[-1], tier="dcp", seconds=time.perf_counter() - t0)
    return done[-1]


def dcp_worker(argv: list[str]) -> int:
    """The training loop of examples/train.py, checkpointing with DCP into --dcp-dir (a directory
    or an s3:// URL). With S3, saves are ``dcp.async_save`` (PyTorch's recommended way to hide a
    slow store): a save waits for the previous one's upload first, and that wait is its stall."""
    import warnings

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ap = argparse.ArgumentParser()
    ap.add_argument("--dcp-worker", action="store_true")
    ap.add_argument("--dcp-dir", required=True)
    ap.add_argument("--dcp-s3-client", choices=DCP_S3_CLIENTS, default="s3torchconnector")
    own, rest = ap.parse_known_args(argv)
    tr = _load_train_module()
    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    args = tr.parse_args(rest)
    jlog = tr.JsonLog(args.log_json)
    jlog("start", job=args.job, rank=args.rank, world_size=args.world_size, pid=os.getpid())
    model, opt, sched, data = tr.build(args)
    extra = {"tokens_seen": 0}
    store = DcpStore(own.dcp_dir, own.dcp_s3_client)

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "sched": sched.state_dict(), "rng": tr.RNGState().state_dict(),
                "data": data.state_dict(), "extra": dict(extra)}

    start = _dcp_resume(store, state, lambda sd: (
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]),
        sched.load_state_dict(sd["sched"]), tr.RNGState().load_state_dict(sd["rng"]),
        data.load_state_dict(sd["data"]), extra.update(sd["extra"])), jlog)
    model.train()
    pending: tuple[int, Any] | None = None

    def settle(block: bool) -> None:
        nonlocal pending
        if pending and (block or pending[1].done()):
            pending[1].result()
            jlog("persisted", step=pending[0])
            pending = None
            store.prune()

    for step in range(start + 1, args.steps + 1):
        loss, tokens = tr.train_step(model, opt, sched, data, args.vocab)
        extra["tokens_seen"] += tokens
        jlog("step", step=step, loss=loss.item(), lr=sched.get_last_lr()[0])
        settle(False)
        if args.save_every and step % args.save_every == 0:
            t0 = time.perf_counter()
            settle(True)  # one upload in flight at a time
            fut = store.save(state(), step)
            pending = (step, fut) if fut is not None else None
            jlog("save", step=step, persist=True, blocking_s=time.perf_counter() - t0)
        if args.stop_after and step >= args.stop_after:
            os._exit(3)
        if args.step_delay:
            time.sleep(args.step_delay)
    settle(True)
    jlog("end")
    return 0


# ---------------------------------------------------------------------------------------------- extrapolation

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, sec. 3.3.4): 466 job interruptions in
# a 54-day snapshot of pre-training on 16,384 H100 GPUs (47 planned, 419 unexpected, about 78% of
# the unexpected ones hardware): one every 2.8 h. Assumed here: the rate is per GPU (so 1,024 GPUs
# see one every 44 h); hardware faults lose the node (node loss 0.76), the rest restart in place
# (crash 0.22), and 2% lose every node's local state (cluster loss; not in the paper, assumed).
LLAMA3_MTBI_16K_S = 54 * 86400 / 466
SCALE_FRACTIONS = {"crash": 0.22, "node": 0.76, "cluster": 0.02}


@dataclass(frozen=True)
class Scale:
    """One job size of the extrapolation and its assumed costs (see bench/README.md)."""

    gpus: int
    state_gb_per_node: float  # model + AdamW, sharded over the job's nodes (8 GPUs each)
    restart_s: float  # job relaunch: scheduler, process start, NCCL init (both policies pay it)
    store_gb_s: float = 100.0  # the job's aggregate object-store bandwidth
    node_cap_gb_s: float = 2.0  # one node's cap on it
    peer_gb_s: float = 12.5  # node to node (100 Gb/s of a 400 Gb/s NIC)
    stage_gb_s: float = 20.0  # device -> host RAM per node: the blocking part of any save

    @property
    def nodes(self) -> int:
        return self.gpus // 8

    @property
    def store_s(self) -> float:
        """Seconds to move one node's state to or from the object store at its share."""
        return self.state_gb_per_node / min(self.node_cap_gb_s, self.store_gb_s / self.nodes)


# A 70B model over 128 nodes: 8.75 GB per node; 405B over 2,048 nodes: 3.2 GB per node; each with
# 100 GB/s and 25 GB/s of object-store bandwidth for the job.
SCALES = tuple(Scale(gpus, params * 16 / (gpus // 8) / 1e9, restart, store)
               for gpus, params, restart in ((1024, 70e9, 60.0), (16384, 405e9, 180.0)) for store in (100.0, 25.0))


def scale_case(sc: Scale, days: float = 30.0, runs: int = 10, seed: int = 1) -> dict[str, Any]:
    """Persistent only (async upload, interval from the planner's baseline) vs tierckpt's plan."""
    fr = SCALE_FRACTIONS
    failures = FailureModel(LLAMA3_MTBI_16K_S * 16384 / sc.gpus, fr["crash"], fr["node"], fr["cluster"])
    stage = sc.state_gb_per_node / sc.stage_gb_s
    peer = sc.state_gb_per_node / sc.peer_gb_s
    # Blocking cost: the device -> host copy for every policy (uploads, peer copies and drains run
    # in the background); restore: relaunch + reading the state from the tier.
    costs = [TierCost("local", stage, sc.restart_s + stage), TierCost("peer", stage, sc.restart_s + peer),
             TierCost("persistent", stage, sc.restart_s + sc.store_s)]
    lag = {"peer": peer, "persistent": sc.store_s}
    base_plan = plan(costs[2:], failures, 1.0)
    # One upload at a time: an interval shorter than the upload would stall on it.
    base_iv = {"persistent": max(base_plan.baseline_interval_s, sc.store_s)}
    # The planner sees no blocking increment for peer and persistent (background copies): it pools
    # them with local. The drain, too, must keep up: persistent at least every upload time.
    tplan = plan([TierCost("local", stage, costs[0].restore_s), TierCost("peer", stage * 1.01, costs[1].restore_s),
                  TierCost("persistent", stage * 1.02, costs[2].restore_s)], failures, 1.0)
    loc = min(v for v in tplan.intervals_s.values() if v)
    persist = max(sc.store_s, tplan.intervals_s["persistent"] or 0.0)
    iv = {"local": loc, "peer": loc, "persistent": loc * max(1, math.ceil(persist / loc))}
    kw = {"work_s": days * 86400, "runs": runs, "lag_s": lag, "nodes": sc.nodes, "replicas": 1,
          "rereplicate_s": peer, "seed": seed}
    return {"scale": sc, "mtbi_s": failures.mtbi_s, "base_iv": base_iv["persistent"], "iv": iv,
            "base": simulate(costs, failures, base_iv, serial=["persistent"], **kw),  # the trainer's own upload
            "tck": simulate(costs, failures, iv, **kw),
            "base_planner": evaluate(costs, failures, base_iv, 1.0).goodput,
            "tck_planner": evaluate(costs, failures, iv, 1.0).goodput}


def extrapolate(days: float = 30.0, runs: int = 10) -> None:
    """Prints the simulator's goodput at 1,024 and 16,384 GPUs (markdown table)."""
    print("| GPUs | MTBI | state/node | store (job) | store r/w per node | policy | intervals (s) | goodput (planner) "
          "| save | restore | lost |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for sc in SCALES:
        r = scale_case(sc, days, runs)
        head = (f"| {sc.gpus:,} | {r['mtbi_s'] / 3600:.1f} h | {sc.state_gb_per_node:.2f} GB | {sc.store_gb_s:g} GB/s "
                f"| {sc.store_s:.0f} s")
        for name, res, ivs, pred in (("persistent only", r["base"], f"{r['base_iv']:.0f}", r["base_planner"]),
                                     ("tierckpt", r["tck"], "{local:.0f} / {peer:.0f} / {persistent:.0f}".format(
                                         **r["iv"]), r["tck_planner"])):
            b = res.badput
            print(f"{head} | {name} | {ivs} | **{res.goodput:.2%}** ({pred:.2%}) | {b.save_overhead:.2%} "
                  f"| {b.restore:.2%} | {b.lost_compute:.2%} |")


# ---------------------------------------------------------------------------------------------- main


def parse_fractions(text: str) -> dict[str, float]:
    vals = [float(v) for v in text.split(",")]
    if len(vals) != 3 or abs(sum(vals) - 1) > 1e-6 or min(vals) < 0:
        raise argparse.ArgumentTypeError("--fractions: three shares crash,node,cluster summing to 1")
    return dict(zip(KINDS, vals))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--s3", action="store_true",
                    help="large-state regime: 512 MiB per rank, persistent tier and DCP (async_save) on S3 (moto) "
                         "behind a bandwidth limit")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default 800; quick 500; s3 500)")
    ap.add_argument("--mtbi", type=float, default=None,
                    help="mean seconds between failures (default 30; quick 10; s3 60)")
    ap.add_argument("--fractions", type=parse_fractions, default=parse_fractions("0.6,0.3,0.1"),
                    help="shares of crash,node,cluster failures (default 0.6,0.3,0.1)")
    ap.add_argument("--s3-rate", type=float, default=64.0, metavar="MIB_S",
                    help="object-store bandwidth per direction, MiB/s (default 64: the 512 MiB state in 8 s)")
    ap.add_argument("--dcp-s3-client", choices=("auto", *DCP_S3_CLIENTS), default="auto",
                    help="the DCP arm's S3 storage with --s3 (auto: s3torchconnector where installed, else s3fs)")
    ap.add_argument("--sweep", default="", metavar="F,F,...",
                    help="also run the DCP arm at these multiples of its planned interval (same failure schedule)")
    ap.add_argument("--seed", type=int, default=1, help="failure schedule seed")
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller model, fewer steps, MTBI 10 s")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs (logs) and print where")
    args = ap.parse_args(argv)
    args.steps = args.steps or (500 if args.quick or args.s3 else 800)
    args.mtbi = args.mtbi or (10.0 if args.quick else 60.0 if args.s3 else 30.0)
    args.model = LARGE_MODEL if args.s3 else QUICK_MODEL if args.quick else MODEL
    args.sweep = [float(f) for f in args.sweep.split(",") if f]
    return args


def calibrate(args: argparse.Namespace, work: Path, sock: Path, logs: Path, store: ObjectStore | None) -> dict:
    """Measures both arms' inputs and plans their intervals (before the arms run)."""
    fr = args.fractions
    failures = FailureModel(args.mtbi, fr["crash"], fr["node"], fr["cluster"])
    # S3: saves far enough apart for one upload (8 s) to finish before the next starts.
    cal_steps, every, persist = (80, 20, 20) if store else (60 if args.quick else 80, 5, 10)
    cd = calibrate_dcp(work, logs, args.model, cal_steps, every, store)
    ct = calibrate_tierckpt(work, sock, logs, args.model, cal_steps, persist, store)
    step_s = cd["step_s"]
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
    dcp_costs = [TierCost("persistent", cd["persist_cost_s"], restart + cd["restore_s"])]
    dplan = plan(dcp_costs, failures, step_s)
    # A save is on the peer / persistent tier this long after it ends (the simulator's lag); the
    # drain moves the same bytes through the same limit as DCP's upload, measured on the DCP arm.
    lag = {"peer": PEER_LAG_S, "persistent": cd["upload_s"]}
    # One upload in flight: a DCP interval shorter than the upload would stall on it, so the
    # planner's baseline is floored at the measured upload time (a practitioner would do the same).
    dcp_every = max(dplan.baseline_interval_steps, math.ceil(cd.get("upload_s", 0.0) / step_s))
    return {"failures": failures, "ct": ct, "cd": cd, "step_s": step_s, "lag_s": lag, "restart": restart,
            "costs": costs, "dcp_costs": dcp_costs, "tplan": tplan, "dplan": dplan, "iv": iv,
            "save_every": min(s for s in iv.values() if s), "persist_every": iv["persistent"] or 0,
            "dcp_every": dcp_every}


def print_calibration(c: dict) -> None:
    ct, cd, iv = c["ct"], c["cd"], c["iv"]
    print(f"clean step {c['step_s'] * 1e3:.1f} ms; save stall / effective cost: tierckpt local+peer "
          f"{ct['local_stall_s'] * 1e3:.0f} / {ct['local_cost_s'] * 1e3:.0f} ms, +persistent "
          f"{ct['persist_stall_s'] * 1e3:.0f} / {ct['persist_cost_s'] * 1e3:.0f} ms, DCP "
          f"{cd['persist_stall_s'] * 1e3:.0f} / {cd['persist_cost_s'] * 1e3:.0f} ms")
    print(f"process restart {c['restart']:.2f} s (median of {len(ct['restarts_s']) + 1}); restore after it: "
          f"local {ct['local_restore_s'] * 1e3:.0f} ms, peer {ct['peer_restore_s'] * 1e3:.0f} ms, persistent "
          f"{ct['persistent_restore_s'] * 1e3:.0f} ms, DCP {cd['restore_s'] * 1e3:.0f} ms; daemon replacement: "
          f"node {ct['node_replacement_s']:.2f} s, cluster {ct['cluster_replacement_s']:.2f} s")
    print(f"planner: tierckpt local/peer/persistent every {iv['local']}/{iv['peer']}/{iv['persistent']} steps "
          f"(--save-every {c['save_every']} --persist-every {c['persist_every']}); DCP every {c['dcp_every']} steps "
          f"(Daly {c['dplan'].baseline_interval_steps}, upload {cd.get('upload_s', 0.0):.1f} s)")
    dcp = evaluate(c["dcp_costs"], c["failures"], {"persistent": c["dcp_every"] * c["step_s"]}, c["step_s"]).goodput
    print(f"planner's goodput: tierckpt {c['tplan'].goodput:.1%}, DCP (persistent only, every {c['dcp_every']} "
          f"steps) {dcp:.1%}: predicted margin {(c['tplan'].goodput - dcp) * 100:+.1f} points", flush=True)


def run_arms(args: argparse.Namespace, c: dict, work: Path, sock: Path, logs: Path,
             store: ObjectStore | None) -> dict[str, list[Incarnation]]:
    """The two arms, then the DCP interval sweep, each under the same failure schedule."""
    runs = [("tierckpt", None), ("dcp", c["dcp_every"])]
    runs += [(f"dcp-x{f:g}", max(1, round(f * c["dcp_every"]))) for f in args.sweep]
    incs = {}
    for name, every in runs:
        print(f"arm {name}:" + (f" DCP every {every} steps" if every else ""), flush=True)
        if every is None:
            arm: Any = TierckptArm(work / name, sock / name, c["persist_every"], store)
            cmd = {"steps": args.steps, "save_every": c["save_every"], "persist_every": c["persist_every"],
                   "model": args.model}
        else:
            arm = DcpArm(work / name, store)
            arm.name = name
            cmd = {"steps": args.steps, "save_every": every, "persist_every": 0, "model": args.model}
        try:
            incs[name] = run_arm(arm, logs, failure_schedule(args.seed, args.mtbi, args.fractions), cmd,
                                 timeout=20 * args.steps * c["step_s"] + 600)
        finally:
            arm.close()
            if store:
                store.delete_prefix(store.url(f"tck-{name}") if every is None else arm.target)
    return incs


def predict(results: dict[str, dict], c: dict, args: argparse.Namespace) -> None:
    """Adds the planner's goodput for the intervals each arm used, at the planned and realized MTBI."""
    fr, step_s = args.fractions, c["step_s"]
    for name, res in results.items():
        if name == "tierckpt":
            cost, ivs = c["costs"], {t: (n * step_s if n else None) for t, n in c["iv"].items()}
        else:
            every = c["dcp_every"] if name == "dcp" else max(1, round(float(name[5:]) * c["dcp_every"]))
            cost, ivs = c["dcp_costs"], {"persistent": every * step_s}
            res["interval_steps"] = every
        res["predicted"] = evaluate(cost, c["failures"], ivs, step_s).goodput
        res["simulated"] = simulate(cost, c["failures"], ivs, work_s=args.steps * step_s, runs=SIM_RUNS,
                                    lag_s=c["lag_s"], seed=args.seed,
                                    serial=() if name == "tierckpt" else ["persistent"]).goodput
        n = sum(res["failures"].values())
        real = FailureModel((res["wall_s"] - res["startup_s"] - res["exit_s"]) / n, fr["crash"], fr["node"],
                            fr["cluster"]) if n else None
        res["predicted_realized"] = evaluate(cost, real, ivs, step_s).goodput if real else None
        res["simulated_realized"] = simulate(cost, real, ivs, work_s=args.steps * step_s, runs=SIM_RUNS,
                                             lag_s=c["lag_s"], seed=args.seed,
                                             serial=() if name == "tierckpt" else ["persistent"]).goodput \
            if real else None


SWEEP_FACTORS = (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3)


def sim_sweep(c: dict, args: argparse.Namespace, factors: tuple[float, ...] = SWEEP_FACTORS) -> dict:
    """The simulator's goodput for DCP at multiples of its planned interval (same inputs as the arms)."""
    out = {}
    for f in factors:
        every = max(1, round(f * c["dcp_every"]))
        out[every] = simulate(c["dcp_costs"], c["failures"], {"persistent": every * c["step_s"]},
                              work_s=args.steps * c["step_s"], runs=SIM_RUNS, lag_s=c["lag_s"], seed=args.seed,
                              serial=["persistent"]).goodput
    best = max(out, key=out.__getitem__)
    print("simulated DCP interval sweep (steps: goodput): " + ", ".join(f"{k}: {v:.1%}" for k, v in out.items())
          + f"; best {best}, planned {c['dcp_every']}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--dcp-worker" in argv:
        return dcp_worker(argv)
    if "--extrapolate" in argv:
        extrapolate()
        return 0
    args = parse_args(argv)
    fr = args.fractions
    from tierckptd.testing import scratch_dir

    work = Path(tempfile.mkdtemp(prefix="tck-goodput-"))  # persistent tier and DCP: disk, not tmpfs
    sock = scratch_dir("tck-gp-")  # daemons' local dirs (tmpfs) and sockets
    logs = work / "logs"
    logs.mkdir()
    print(f"model {' '.join(args.model)}; {args.steps} steps per arm; MTBI {args.mtbi:g} s (crash {fr['crash']:.0%}, "
          f"node {fr['node']:.0%}, cluster {fr['cluster']:.0%}); seed {args.seed}")
    store = ObjectStore(work, args.s3_rate * 2**20, dcp_s3_client(args.dcp_s3_client)) if args.s3 else None
    if store:
        print(f"persistent tier and DCP: S3 (moto_server) through a {args.s3_rate:g} MiB/s limit per direction "
              f"(DCP through {store.dcp_client}); local tier on {fstype(sock)} ({sock})")
    else:
        print(f"DCP dir and persistent tier on {fstype(work)} ({work}); local tier on {fstype(sock)} ({sock})")
    try:
        print("calibrating (clean steps, save stalls, a crash, a node loss and a cluster loss) ...", flush=True)
        c = calibrate(args, work, sock, logs, store)
        print_calibration(c)
        c["sim_sweep"] = sim_sweep(c, args)
        incs = run_arms(args, c, work, sock, logs, store)
        # Useful step time: each arm's own median step (no save in it), which cancels drift in the
        # outside load between the arms; the wall-time ratio is printed too.
        results = {name: account(incs[name], args.steps) for name in incs}
        predict(results, c, args)
        report(results, args.steps, c["step_s"])
        if args.json:
            Path(args.json).write_text(json.dumps({
                "steps": args.steps, "mtbi_s": args.mtbi, "fractions": fr, "seed": args.seed,
                "model": list(args.model), "s3_rate_mib_s": args.s3_rate if store else None,
                "dcp_s3_client": store.dcp_client if store else None,
                "calibration": {"tierckpt": c["ct"], "dcp": c["cd"]}, "plan": c["tplan"].to_dict(),
                "dcp_plan": c["dplan"].to_dict(), "intervals_steps": {
                    "save_every": c["save_every"], "persist_every": c["persist_every"], "dcp_every": c["dcp_every"]},
                "calibration_step_s": c["step_s"], "lag_s": c["lag_s"], "sim_sweep": c["sim_sweep"],
                "arms": results}, indent=2))
    finally:
        if store:
            store.close()
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
            ("simulator's prediction", lambda a: f"{a['simulated']:.1%}"),
            ("  at the realized MTBI", lambda a: "-" if a["simulated_realized"] is None
             else f"{a['simulated_realized']:.1%}"),
            ("final loss", lambda a: f"{a['final_loss']:.6f}" if a["final_loss"] is not None else "-")]
    names = list(results)
    print(f"{'':<28}" + "".join(f" {'DCP' if n == 'dcp' else n:>22}" for n in names))
    for label, fn in rows:
        print(f"{label:<28}" + "".join(f" {fn(results[n]):>22}" for n in names))
    print(f"goodput margin tierckpt - DCP: measured {(t['goodput'] - d['goodput']) * 100:+.1f} points "
          f"(without start-up and exit {(t['goodput_steady'] - d['goodput_steady']) * 100:+.1f}); planner "
          f"{(t['predicted'] - d['predicted']) * 100:+.1f} points, simulator "
          f"{(t['simulated'] - d['simulated']) * 100:+.1f}")
    sweep = {n: r for n, r in results.items() if n.startswith("dcp")}
    if len(sweep) > 1:
        best = max(sweep, key=lambda n: sweep[n]["goodput_steady"])
        print("DCP interval sweep (steps: goodput without start-up/exit): " + ", ".join(
            f"{r['interval_steps']}: {r['goodput_steady']:.1%}" for r in sorted(sweep.values(),
                                                                               key=lambda r: r["interval_steps"]))
              + f"; best {sweep[best]['interval_steps']}, planned {d['interval_steps']}")
    print(f"goodput ratio tierckpt/DCP: {t['goodput'] / d['goodput']:.2f}x "
          f"(without start-up and exit {t['goodput_steady'] / d['goodput_steady']:.2f}x; "
          f"wall-time ratio DCP/tierckpt {d['wall_s'] / t['wall_s']:.2f}x; "
          f"predicted {t['predicted'] / d['predicted']:.2f}x)")
    if t["final_loss"] != d["final_loss"]:
        print("WARNING: the arms' final losses differ: a resume was not exact")


if __name__ == "__main__":
    sys.exit(main())
