"""Cluster scale: idle background cost, per-rank and cluster-wide queries, restore after node
replacement, as the number of nodes N grows.

For each N: N daemons on loopback, ``--peers`` listing all, ``--replicas 1``, local dirs on tmpfs,
a job of world size N with two small committed steps (rank i saved on node i, replicated to its
ring successor). Then, idle (no saves):

1. idle CPU of each daemon (utime + stime from /proc/PID/stat over ``--window`` seconds);
2. TCP payload bytes each daemon sent over the window (``ss -tinp``, all its connections: the
   requests it made and the answers it served; idle, that is control traffic only); control RPCs
   per second each daemon made to peers and the distinct peers it called (deltas of
   ``tierckpt_peer_calls_total`` over the same window, where the daemon has that metric), and
   calls to peers outside the node's ring neighbourhood (R+1 successors, R+1 predecessors);
3. ``availability(job, rank)`` latency from one node (median of ``--avail-calls``; only where the
   client has it) and ``latest(job)`` latency (median of ``--latest-calls``);
4. restore after replacement: kill -9 a node, wipe its local dir, start a replacement with the
   same id and port, time ``restore(job, rank)`` of its rank (fetched from its ring successor;
   the daemon picks the step with latest(), which asks every node); then again with the at-scale
   path, ``availability(job, rank)`` + ``restore(job, rank, step)`` (only where the client has it).

Diagnostics, not the target: "status ms" is a query the queried daemon answers alone (no peer
call): how much of a latency change is the machine (two shared cores, N Python daemons) rather
than the protocol. Calls are spaced by ``--spacing`` seconds (0.1), so that a median spans a
few seconds of the machine's load rather than one burst of it.
Next to each query: the peer RPCs it cost the daemon that answered (``tierckpt_peer_calls_total``
deltas; background polls in the same moments are included, so fractions of a call are noise).

Prints one markdown table and exits 1 when the target is missed: at the largest N, idle CPU per
daemon (mean) and availability latency within ``--target``x (1.5) of N=4 (the smallest N).

With ``--redundancy parity:K+M`` the daemons protect with parity instead of replicas (no
``--replicas``): the replaced node's rank is then reconstructed from its group's parity, and a
call to a peer outside the node's neighbourhood *and* its parity group is flagged.

Usage: .venv/bin/python bench/scale.py [--sizes 4,8,16,32] [--window 20] [--redundancy parity:4+1]
The same script measures an older tree with PYTHONPATH=/other/client:/other/daemon (daemons
inherit it); what that tree lacks (Availability, the peer_calls metric) is reported as n/a.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import tierckpt
from tierckptd.parity import layout
from tierckptd.testing import Daemon, free_port, scratch_dir

JOB = "scale"
REPLICAS = 1
CLK_TCK = os.sysconf("SC_CLK_TCK")
_CALLS_RE = re.compile(r'^tierckpt_peer_calls_total\{peer="([^"]+)"\}\s+([0-9.eE+-]+)$', re.M)


def reserve_ports(k: int) -> list[int]:
    """k distinct free ports outside the kernel's ephemeral range (see ``tierckptd.testing.free_port``)."""
    return [free_port() for _ in range(k)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


_SS_PID_RE = re.compile(r"pid=(\d+),")
_SS_BYTES_RE = re.compile(r"\bbytes_sent:(\d+)")


def tcp_sent(pids: set[int]) -> dict[tuple[int, str], int] | None:
    """Payload bytes sent so far on each established TCP socket of ``pids`` ({(pid, socket): bytes},
    from ``ss -tinp``), or None without ss."""
    try:
        text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out: dict[tuple[int, str], int] = {}
    head = None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            head = line
            continue
        pid = _SS_PID_RE.search(head or "")
        sent = _SS_BYTES_RE.search(line)
        if pid and int(pid.group(1)) in pids:
            key = (int(pid.group(1)), " ".join((head or "").split()[2:4]))
            out[key] = int(sent.group(1)) if sent else 0
    return out


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peer_calls(metrics_port: int | None) -> dict[str, float] | None:
    """{peer: calls so far} from the daemon's /metrics, or None without the metric."""
    if not metrics_port:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    if "tierckpt_peer_calls_total" not in text:
        return None
    return {peer: float(v) for peer, v in _CALLS_RE.findall(text)}


def calls_per(before: dict[str, float] | None, after: dict[str, float] | None, n: int) -> float | None:
    """Peer calls per operation between two scrapes of one daemon (None without the metric)."""
    if before is None or after is None:
        return None
    return sum(v - before.get(p, 0.0) for p, v in after.items()) / n


def neighbourhood(node: str, ids: list[str], replicas: int) -> set[str]:
    """R+1 successors and R+1 predecessors on the ring of sorted ids (every node up)."""
    ring = sorted(ids)
    i = ring.index(node)
    succ = ring[i + 1:] + ring[:i]
    k = replicas + 1
    return set(succ[:k]) | set(succ[::-1][:k])


def near(node: str, ids: list[str], redundancy: str) -> set[str]:
    """The peers a node is expected to call: its ring neighbourhood, and under parity its group."""
    out = neighbourhood(node, ids, REPLICAS)
    if redundancy.startswith("parity:"):
        k, m = (int(x) for x in redundancy.split(":", 1)[1].split("+"))
        out |= set(layout.group_of(node, ids, k + m, m + 1)) - {node}
    return out


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
        except tierckpt.TierckptError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def median_ms(fn, n: int, spacing: float) -> float:
    fn()  # warm-up (channel, first call)
    times = []
    for _ in range(n):
        time.sleep(spacing)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_size(n: int, args) -> dict:
    width = len(str(n - 1))
    ids = [f"n{i:0{width}d}" for i in range(n)]  # zero-padded: ring order = rank order
    reserved = reserve_ports(2 * n)
    ports, mports = dict(zip(ids, reserved[:n])), dict(zip(ids, reserved[n:]))
    peers = ",".join(f"{i}=127.0.0.1:{ports[i]}" for i in ids)
    parity = args.redundancy.startswith("parity:")
    base = ("--peers", peers, *(("--redundancy", args.redundancy) if parity else ("--replicas", str(REPLICAS))))
    root = scratch_dir("tck-scale-")
    ds = {i: Daemon(root, i, port=ports[i], args=(*base, "--metrics-port", str(mports[i]))) for i in ids}
    out: dict = {"n": n, "pred_nbhd": len(near(ids[0], ids, args.redundancy)), "pred_full": n - 1}
    try:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(max_workers=min(n, args.start_parallel)) as ex:
            for f in [ex.submit(d.start, args.start_timeout) for d in ds.values()]:
                f.result()
        out["start_s"] = time.monotonic() - t0
        # Ready: every node sees its ring successor and predecessor up.
        ring = sorted(ids)
        for k, i in enumerate(ring):
            want = {ring[(k + 1) % n], ring[(k - 1) % n]}
            with ds[i].client() as c:
                wait_until(lambda c=c, want=want: want <= {p.node_id for p in c.status().peers if p.up},
                           args.start_timeout,
                           f"{i} sees {sorted(want)} up")
        out["ready_s"] = time.monotonic() - t0
        shard = {"w": os.urandom(args.shard_bytes)}
        clients = {i: ds[i].client() for i in ids}
        try:
            for step in (1, 2):
                futs = [clients[i].save(JOB, step, rank, n, shard, metadata={"step": step})
                        for rank, i in enumerate(ids)]
                for fut in futs:
                    if not fut.wait("peer", timeout=args.start_timeout):
                        raise RuntimeError("a save was not replicated")
        finally:
            for c in clients.values():
                c.close()
        out["saved_s"] = time.monotonic() - t0
        time.sleep(args.settle)  # catalogs propagate, replication settles

        # -- idle window
        pids = {i: ds[i].proc.pid for i in ids}
        calls0 = {i: peer_calls(ds[i].info.get("metrics_port") or mports[i]) for i in ids}
        ts0 = time.monotonic()
        sent0 = tcp_sent(set(pids.values()))
        cpu0 = {i: cpu_seconds(p) for i, p in pids.items()}
        c0 = time.monotonic()
        time.sleep(args.window)
        cpu1 = {i: cpu_seconds(p) for i, p in pids.items()}
        c1 = time.monotonic()
        sent1 = tcp_sent(set(pids.values()))
        calls1 = {i: peer_calls(ds[i].info.get("metrics_port") or mports[i]) for i in ids}
        ts1 = time.monotonic()
        per = [(cpu1[i] - cpu0[i]) / (c1 - c0) for i in ids]
        out["cpu_mean"], out["cpu_max"], out["cpu_all"] = statistics.mean(per), max(per), sum(per)
        out["rss_mean"] = statistics.mean(rss_mib(p) for p in pids.values())
        if sent0 is not None and sent1 is not None:
            # sockets opened during the window count from 0; those closed during it are lost
            per_pid = {p: 0 for p in pids.values()}
            for key, v in sent1.items():
                per_pid[key[0]] += v - sent0.get(key, 0)
            out["bytes_mean"] = statistics.mean(per_pid.values()) / (c1 - c0)
        if all(calls0[i] is not None and calls1[i] is not None for i in ids):
            rates, distinct, outside = [], [], {}
            for i in ids:
                delta = {p: v - calls0[i].get(p, 0.0) for p, v in calls1[i].items()}
                called = {p for p, v in delta.items() if v > 0}
                rates.append(sum(delta.values()) / (ts1 - ts0))
                distinct.append(len(called))
                extra = called - near(i, ids, args.redundancy)
                if extra:
                    outside[i] = sorted(extra)
            out["rpc_mean"], out["rpc_max"] = statistics.mean(rates), max(rates)
            out["distinct_mean"], out["distinct_max"] = statistics.mean(distinct), max(distinct)
            out["outside"] = outside

        # -- queries from one node (n0, rank 0): latency (spaced calls), then the peer calls they
        # cost n0 (a burst of the same calls between two scrapes, so few background polls mix in)
        mp0 = mports[ids[0]]

        def cost(fn, k: int) -> float | None:
            before = peer_calls(mp0)
            for _ in range(k):
                fn()
            return calls_per(before, peer_calls(mp0), k)

        with ds[ids[0]].client() as c:
            if hasattr(c, "availability"):
                steps = [a.step for a in c.availability(JOB, 0)]
                assert 2 in steps, steps
                out["avail_ms"] = median_ms(lambda: c.availability(JOB, 0), args.avail_calls, args.spacing)
                out["avail_calls"] = cost(lambda: c.availability(JOB, 0), args.avail_calls)
            # baseline: a query n0 answers alone (no peer call): how loaded the machine is
            out["status_ms"] = median_ms(c.status, args.avail_calls, args.spacing)
            assert c.latest(JOB) == 2
            out["latest_ms"] = median_ms(lambda: c.latest(JOB), args.latest_calls, args.spacing)
            out["latest_calls"] = cost(lambda: c.latest(JOB), args.latest_calls)

        # -- restore after replacement of the node in the middle of the ring: restore(job, rank)
        # (the daemon picks the step: latest() over every node), then, where the client has
        # availability(), the at-scale path: availability(job, rank) and restore(job, rank, step)
        k = n // 2
        victim = ids[k]
        modes = ["latest"] + (["availability"] if "avail_ms" in out else [])
        for mode in modes:
            ds[victim].kill()
            ds[victim].wipe()
            ds[victim] = Daemon(root, victim, port=ports[victim], args=(*base, "--metrics-port", str(mports[victim])),
                                log_name=f"{victim}-{mode}.log")
            ds[victim].start(args.start_timeout)
            with ds[victim].client() as c:
                before = peer_calls(mports[victim])
                t = time.perf_counter()
                if mode == "latest":
                    ck = c.restore(JOB, k)
                else:
                    ck = c.restore(JOB, k, step=max(a.step for a in c.availability(JOB, k)))
                out[f"restore_{mode}_s"] = time.perf_counter() - t
                out[f"restore_{mode}_calls"] = calls_per(before, peer_calls(mports[victim]), 1)
                assert ck.step == 2 and ck.tier == "peer", (ck.step, ck.tier)
                assert bytes(ck.shards["w"]) == shard["w"]
                del ck
        return out
    finally:
        for d in ds.values():
            try:
                d.kill()
            except (OSError, subprocess.SubprocessError):
                pass
        shutil.rmtree(root, ignore_errors=True)


def fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def calls(r: dict, key: str) -> str:
    return "" if r.get(key) is None else f" ({r[key]:.1f} calls)"


COLUMNS = ("N", "idle CPU/daemon mean", "max", "all daemons (cores)", "RSS/daemon MiB", "peer RPC/s per daemon",
           "model RPC/s: neighbourhood (+ group) / full polling", "TCP bytes/s sent per daemon",
           "distinct peers called mean / max", "status ms", "availability ms", "latest ms",
           "restore s: restore(job, rank) / availability + restore(step)")


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        rpc = "n/a" if "rpc_mean" not in r else f"{r['rpc_mean']:.2f} (max {r['rpc_max']:.2f})"
        dist = "n/a" if "distinct_mean" not in r else f"{r['distinct_mean']:.1f} / {r['distinct_max']}"
        cells = [str(r["n"]), f"{r['cpu_mean'] * 100:.2f}%", f"{r['cpu_max'] * 100:.2f}%", f"{r['cpu_all']:.3f}",
                 f"{r['rss_mean']:.0f}", rpc, f"{r['pred_nbhd']} / {r['pred_full']}", fmt(r.get("bytes_mean"), ".0f"),
                 dist, f"{r['status_ms']:.1f}", fmt(r.get("avail_ms"), ".1f") + calls(r, "avail_calls"),
                 f"{r['latest_ms']:.1f}" + calls(r, "latest_calls"),
                 f"{r['restore_latest_s']:.3f}" + calls(r, "restore_latest_calls") + " / "
                 + fmt(r.get("restore_availability_s"), ".3f") + calls(r, "restore_availability_calls")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8,16,32", help="comma-separated N (default 4,8,16,32)")
    ap.add_argument("--window", type=float, default=20.0, help="idle measurement window, seconds")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds idle before the window")
    ap.add_argument("--avail-calls", type=int, default=20)
    ap.add_argument("--latest-calls", type=int, default=10)
    ap.add_argument("--spacing", type=float, default=0.1, help="seconds between two timed queries")
    ap.add_argument("--shard-bytes", type=int, default=64 << 10)
    ap.add_argument("--start-parallel", type=int, default=4, help="daemons started at once")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--redundancy", default="replicas", help='"replicas" (R = 1) or "parity:K+M"')
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (kill daemons)
    print(f"# tierckpt {getattr(tierckpt, '__file__', '?')}; redundancy {args.redundancy}; "
          f"load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; {os.cpu_count()} cpus", flush=True)
    rows = []
    for n in sizes:
        r = run_size(n, args)
        rows.append(r)
        print(f"N={n}: started in {r['start_s']:.1f}s, ready {r['ready_s']:.1f}s, saved {r['saved_s']:.1f}s; "
              f"idle CPU/daemon mean {r['cpu_mean'] * 100:.2f}% max {r['cpu_max'] * 100:.2f}%, "
              f"all {r['cpu_all']:.3f} cores; RPC/s {fmt(r.get('rpc_mean'), '.2f')}, "
              f"distinct peers {fmt(r.get('distinct_mean'), '.1f')}/{r.get('distinct_max', 'n/a')}; "
              f"availability {fmt(r.get('avail_ms'), '.1f')} ms, latest {r['latest_ms']:.1f} ms, "
              f"restore {r['restore_latest_s']:.3f}s / {fmt(r.get('restore_availability_s'), '.3f')}s; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        if r.get("outside"):
            print(f"  ! daemons calling peers outside their ring neighbourhood (and group): {r['outside']}", flush=True)
    print()
    print(table(rows))
    small, big = rows[0], rows[-1]
    ok = True
    cpu_ratio = big["cpu_mean"] / small["cpu_mean"] if small["cpu_mean"] else float("inf")
    print(f"\nidle CPU per daemon N={big['n']}/N={small['n']}: {cpu_ratio:.2f}x (target <= {args.target}x): "
          f"{'PASS' if cpu_ratio <= args.target else 'FAIL'}")
    ok &= cpu_ratio <= args.target
    if "avail_ms" in small and "avail_ms" in big:
        av_ratio = big["avail_ms"] / small["avail_ms"]
        print(f"availability latency N={big['n']}/N={small['n']}: {av_ratio:.2f}x (target <= {args.target}x): "
              f"{'PASS' if av_ratio <= args.target else 'FAIL'}")
        ok &= av_ratio <= args.target
        base = (big["avail_ms"] - big["status_ms"]) / max(1e-9, small["avail_ms"] - small["status_ms"])
        print(f"  (diagnostic, not the target: availability minus the status() baseline of the same daemon, "
              f"N={big['n']}/N={small['n']}: {base:.2f}x; status() alone {big['status_ms'] / small['status_ms']:.2f}x)")
    else:
        print("availability latency: n/a (this client has no availability())")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
