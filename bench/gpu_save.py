"""GPU-resident state: saves that do not stop the GPU (issue 31), side by side in one run, on one GPU.

State on the GPU: ``--gib`` GiB (default 6) split as bf16 weights (1/5) and fp32 Adam state
(exp_avg and exp_avg_sq, 2/5 each), in ``--tensors`` weight tensors, owned by a small Adam-like
optimizer (so the save's pre-step wait is exercised). Printed, each the median of ``--runs``:

- floor: cudaMemcpy device-to-host of every tensor into pinned memory (non_blocking copies on
  one stream, then a synchronize): the physical bound for "time to staged";
- tierckpt: ``Checkpointer.save()`` blocking time, time to ``staged``, time to committed (local
  tier on tmpfs); whether the staging maps were page-locked (else: the pinned pool);
- DCP: ``dcp.async_save`` with ``DefaultStager`` (pinned memory, async staging, non-blocking
  copies) into ``FileSystemWriter`` on the same tmpfs: blocking, staged, uploaded; and with
  ``tierckpt.dcp.Stager`` + ``tierckpt.dcp.Writer``;
- step-time inflation of a bf16 matmul training loop (``--matmuls`` 8192^2 matmuls per step, then
  the optimizer step over the whole state) while saves run every ``--every`` steps, vs the same
  loop without saves;
- host memory: the process's peak RSS (VmHWM) growth during the tierckpt saves vs one copy of
  the state, and the bytes the local tier holds per step.

Targets (issue 31): blocking <= 50 ms; time to staged <= 1.2x the floor; step-time inflation <= 5%;
host memory = one copy of the state.

Usage: python bench/gpu_save.py [--gib 6] [--tensors 48] [--runs 3] [--steps 60] [--every 15]
Without a CUDA GPU it prints why and exits with status 2. ``--cpu-smoke`` runs the same code on the
CPU with a small state (plain memory instead of pinned, no streams): a check that the script
works, not a measurement (tests/test_gpu_bench.py runs it).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEV = "cuda"  # "cpu" with --cpu-smoke


def _sync(torch) -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _hwm_bytes() -> int:
    """The process's peak resident set (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def make_state(torch, gib: float, tensors: int):
    """bf16 weights (1/5 of the bytes) and fp32 exp_avg / exp_avg_sq (2/5 each), on the GPU."""
    params = int(gib * (1 << 30) / 10) // tensors  # 2 + 4 + 4 bytes per parameter
    ws = [torch.randn(params, device=DEV).to(torch.bfloat16).requires_grad_() for _ in range(tensors)]

    class Adamish(torch.optim.Optimizer):
        """Adam's memory traffic (foreach ops over fp32 moments and bf16 weights); gradients are
        stand-ins (the weights themselves) so the loop measures the copy's interference only."""

        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4})
            for p in self.param_groups[0]["params"]:
                self.state[p] = {"exp_avg": torch.zeros(p.shape, device=DEV),
                                 "exp_avg_sq": torch.zeros(p.shape, device=DEV)}

        @torch.no_grad()
        def step(self, closure=None):
            ps = self.param_groups[0]["params"]
            m = [self.state[p]["exp_avg"] for p in ps]
            v = [self.state[p]["exp_avg_sq"] for p in ps]
            g = [p.float() for p in ps[:1]] * len(ps)  # one fp32 gradient stand-in, reused
            torch._foreach_mul_(m, 0.9)
            torch._foreach_add_(m, g, alpha=0.1)
            torch._foreach_mul_(v, 0.999)
            torch._foreach_addcmul_(v, g, g, value=0.001)
            torch._foreach_add_(ps, [x.to(torch.bfloat16) for x in m[:1]] * len(ps), alpha=-1e-4)

    opt = Adamish(ws)
    nbytes = sum(w.numel() * (2 + 4 + 4) for w in ws)
    return {"weights": {f"w{i}": w for i, w in enumerate(ws)}, "optim": opt}, ws, opt, nbytes


def all_tensors(torch, ws, opt) -> list:
    return [*ws, *(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))]


def floor(torch, tensors, runs: int) -> float:
    """Seconds to copy every tensor device-to-host into pinned memory (one stream, one sync)."""
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=DEV == "cuda") for t in tensors]
    times = []
    for _ in range(runs + 1):
        _sync(torch)
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t.detach(), non_blocking=True)
        _sync(torch)
        times.append(time.perf_counter() - t0)
    del dst
    return statistics.median(times[1:])


def tierckpt_saves(torch, state, ck, runs: int, first_step: int) -> dict:
    blocking, staged, committed = [], [], []
    for i in range(runs + 1):
        _sync(torch)
        t0 = time.perf_counter()
        fut = ck.save(first_step + i, state)
        t1 = time.perf_counter()
        fut.staged.result()
        t2 = time.perf_counter()
        fut.result()
        t3 = time.perf_counter()
        if i:  # the first save maps fresh files; later ones reuse the evicted step's
            blocking.append(t1 - t0)
            staged.append(t2 - t0)
            committed.append(t3 - t0)
    return {"blocking": statistics.median(blocking), "staged": statistics.median(staged),
            "committed": statistics.median(committed)}


def dcp_saves(torch, state_dict, runs: int, writer_for, stager_for) -> dict:
    import torch.distributed.checkpoint as dcp

    blocking, staged, uploaded = [], [], []
    for i in range(runs + 1):
        stager = stager_for()
        _sync(torch)
        t0 = time.perf_counter()
        resp = dcp.async_save(state_dict, storage_writer=writer_for(i), async_stager=stager, no_dist=True)
        t1 = time.perf_counter()
        resp.staging_completion.result()
        t2 = time.perf_counter()
        resp.upload_completion.result()
        t3 = time.perf_counter()
        stager.close()
        if i:
            blocking.append(t1 - t0)
            staged.append(t2 - t0)
            uploaded.append(t3 - t0)
    return {"blocking": statistics.median(blocking), "staged": statistics.median(staged),
            "committed": statistics.median(uploaded)}


def train_loop(torch, opt, steps: int, matmuls: int, save=None, every: int = 0) -> float:
    """Median seconds per training step (matmuls, then the optimizer step), saving every ``every`` steps."""
    n = 8192 if DEV == "cuda" else 256
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16) / n ** 0.5
    times = []
    _sync(torch)
    for s in range(steps):
        t0 = time.perf_counter()
        x = a
        for _ in range(matmuls):
            x = x @ a
        opt.step()
        if save is not None and every and s % every == 0:
            save(s)
        _sync(torch)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--matmuls", type=int, default=40)
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run on the CPU, small: checks the script, measures nothing")
    args = ap.parse_args()
    global DEV

    try:
        import torch
    except ImportError:
        print("bench/gpu_save.py needs torch (pip install tierckpt[torch]); not run", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        print("bench/gpu_save.py needs a CUDA GPU (torch.cuda.is_available() is False); not run. "
              "Its figures in bench/README.md are recorded only from a GPU machine.", file=sys.stderr)
        return 2

    import tierckpt
    import tierckpt.dcp as tdcp
    from tierckpt.torch import Checkpointer
    from tierckptd.testing import Daemon, scratch_dir
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    state, ws, opt, nbytes = make_state(torch, args.gib, args.tensors)
    gib = nbytes / (1 << 30)
    where = torch.cuda.get_device_name() if DEV == "cuda" else "CPU SMOKE RUN (not a measurement)"
    print(f"device: {where}; state {gib:.2f} GiB on {DEV} ({len(ws)} bf16 weights, "
          f"2 fp32 moments each); torch {torch.__version__}")
    tensors = all_tensors(torch, ws, opt)

    fl = floor(torch, tensors, args.runs)
    print(f"floor   cudaMemcpy D2H into pinned: {fl * 1e3:8.1f} ms ({gib / fl:.1f} GiB/s)")

    work = scratch_dir("gpu-bench-")
    daemon = Daemon(work, "gpubench", args=("--keep-local", "1")).start()
    fs_dir = Path(tempfile.mkdtemp(prefix="dcp-", dir=str(work)))
    try:
        with Checkpointer("gpubench", address=daemon.address, pack_below=1 << 20) as ck:
            _reset_hwm()
            hwm0 = _hwm_bytes()
            tk = tierckpt_saves(torch, state, ck, args.runs, 1)
            hwm = _hwm_bytes() - hwm0
            refused = ck._copier.refused
            maps = "NOT page-locked (pinned pool)" if refused else "page-locked"
            print(f"tierckpt Checkpointer.save: blocking {tk['blocking'] * 1e3:8.1f} ms | staged "
                  f"{tk['staged'] * 1e3:8.1f} ms ({tk['staged'] / fl:.2f}x floor) | committed "
                  f"{tk['committed'] * 1e3:8.1f} ms | staging maps {maps}")
            print(f"host memory: peak RSS grew {hwm / (1 << 30):.2f} GiB during the saves "
                  f"({hwm / nbytes:.2f}x one copy of the state; the mapped staging files count once)")

            base = train_loop(torch, opt, args.steps, args.matmuls)
            step_no = [1000]

            def save(_s: int) -> None:
                step_no[0] += 1
                ck.save(step_no[0], state)

            loaded = train_loop(torch, opt, args.steps, args.matmuls, save, args.every)
            ck.wait()
            print(f"training step: {base * 1e3:.1f} ms without saves, {loaded * 1e3:.1f} ms with a save every "
                  f"{args.every} steps: inflation {100 * (loaded / base - 1):+.1f}%")

        results = {"tierckpt": tk}
        if not args.skip_dcp:
            sd = {"weights": state["weights"], "optim": opt.state_dict()}
            opts = StagingOptions(use_pinned_memory=DEV == "cuda", use_shared_memory=False, use_async_staging=True,
                                  use_non_blocking_copy=DEV == "cuda")
            results["dcp DefaultStager"] = dcp_saves(
                torch, sd, args.runs, lambda i: FileSystemWriter(str(fs_dir / f"s{i}")), lambda: DefaultStager(opts))
            with tierckpt.Client(daemon.address) as c:
                results["dcp tierckpt.Stager"] = dcp_saves(
                    torch, sd, args.runs, lambda i: tdcp.Writer("dcpbench", i + 1, client=c), tdcp.Stager)
        print()
        print("| saver | blocking ms | staged ms | staged / floor | committed ms |")
        print("|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['blocking'] * 1e3:.1f} | {r['staged'] * 1e3:.1f} | {r['staged'] / fl:.2f} | "
                  f"{r['committed'] * 1e3:.1f} |")
        print(f"| floor (cudaMemcpy D2H, pinned) | | {fl * 1e3:.1f} | 1.00 | |")
        print()
        if DEV != "cuda":
            print("CPU smoke run: the script works; no target is evaluated (run it on a GPU)")
            return 0
        ok = {"blocking <= 50 ms": tk["blocking"] <= 0.05, "staged <= 1.2x floor": tk["staged"] <= 1.2 * fl,
              "step-time inflation <= 5%": loaded <= 1.05 * base, "host memory ~ one copy": hwm <= 1.1 * nbytes}
        for k, v in ok.items():
            print(f"target {k}: {'met' if v else 'NOT met'}")
    finally:
        daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
