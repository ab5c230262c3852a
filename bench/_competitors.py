"""The local-tier competitors at their best, for bench/local_tier.py (same tmpfs, same state, same run).

- DCP 2.13 ``dcp.async_save`` with a ``DefaultStager`` (``StagingOptions``): the fastest staging
  options that work on this machine (pinned memory and non-blocking copies need an accelerator;
  each combination is tried and the fastest that works is kept), once with the default THREAD
  checkpointer and once with ``AsyncCheckpointerType.PROCESS`` (a background writer process).
  The stager is reused across saves, as a trainer would (its staging buffers are cached), and
  ``FileSystemWriter`` writes with two threads (default one).
- torch-checkpointing's ``CheckpointManager`` (async staging into shared memory, a background
  write process), saving to the same tmpfs and loading back.

Two blocking figures per async saver: "returns" (the call came back) and "state free" (the
staging copy is done, so the caller may change the tensors again: ``staging_completion`` for
DCP, ``manager.lock()`` for torch-checkpointing). tierckpt's save() returns with the state free,
so "state free" is the figure its blocking time is compared with.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WRITE_THREADS = 2
"""FileSystemWriter's write threads in the DefaultStager arms (default 1): one per core here."""


def _staging_candidates() -> list[tuple[str, Any]]:
    """(label, StagingOptions) for every combination that can work here, most features first:
    pinned memory and non-blocking copies only with an accelerator (without one, DCP ignores the
    first with a warning and refuses the second)."""
    import torch
    from torch.distributed.checkpoint.staging import StagingOptions

    accel = (True, False) if torch.accelerator.is_available() else (False,)
    if not torch.accelerator.is_available():
        print("  DefaultStager: no accelerator here, so no pinned memory and no non-blocking copies")
    out = []
    for pinned, shared, non_blocking in itertools.product(accel, (True, False), accel):
        opts = StagingOptions(use_pinned_memory=pinned, use_shared_memory=shared, use_async_staging=True,
                              use_non_blocking_copy=non_blocking)
        label = "+".join(n for n, on in (("pinned", pinned), ("shared", shared), ("async", True),
                                         ("non-blocking", non_blocking)) if on)
        out.append((label, opts))
    return out


def _dcp_async(tensors: dict, path: Callable[[], Path], stager: Any, kind: Any) -> tuple[float, float, Any]:
    """One ``dcp.async_save``: (seconds to return, seconds until the state is free, upload future)."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(path(), thread_count=WRITE_THREADS)
    resp = dcp.async_save(tensors, storage_writer=writer, async_stager=stager,
                          async_checkpointer_type=kind)
    returned = time.perf_counter() - t0
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:
        staging.result()
    free = time.perf_counter() - t0
    return returned, free, getattr(resp, "upload_completion", resp)


def dcp_best_stager(tensors: dict, path: Callable[[], Path], clean: Callable[[], None]) -> tuple[str, Any]:
    """The staging options whose save frees the state soonest (one warm save + one timed each)."""
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    best: tuple[float, str, Any] | None = None
    for label, opts in _staging_candidates():
        try:
            stager = DefaultStager(opts)
        except (AssertionError, RuntimeError) as e:  # pinned / non-blocking without an accelerator
            print(f"  DefaultStager({label}): not on this machine ({str(e).splitlines()[0][:80]})")
            continue
        try:
            free = []
            for _ in range(2):
                clean()
                _, f, up = _dcp_async(tensors, path, stager, AsyncCheckpointerType.THREAD)
                up.result()
                free.append(f)
        except (AssertionError, RuntimeError) as e:
            print(f"  DefaultStager({label}): failed ({str(e).splitlines()[0][:80]})")
            stager.close()
            continue
        stager.close()
        print(f"  DefaultStager({label}): state free after {free[-1]:.3f} s")
        if best is None or free[-1] < best[0]:
            best = (free[-1], label, opts)
    if best is None:
        raise SystemExit("no DefaultStager configuration works here")
    return best[1], best[2]


def dcp_competitors(tensors: dict, work: Path, runs: int, results: dict[str, float]) -> str:
    """DCP async_save with the best DefaultStager, THREAD and PROCESS checkpointers; returns the
    options used. Needs the process group bench/local_tier.py has initialized."""
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    base = work / "dcp-best"
    counter = itertools.count()

    def path() -> Path:
        return base / str(next(counter))

    def clean() -> None:
        shutil.rmtree(base, ignore_errors=True)

    label, opts = dcp_best_stager(tensors, path, clean)
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        stager = DefaultStager(opts)
        returned, free, done = [], [], []
        try:
            for i in range(runs + 1):  # the first warms the stager's buffers (and starts the process)
                clean()
                t0 = time.perf_counter()
                r, f, up = _dcp_async(tensors, path, stager, kind)
                up.result()
                if i:
                    returned.append(r)
                    free.append(f)
                    done.append(time.perf_counter() - t0)
        finally:
            stager.close()
        name = f"dcp.async_save {kind.value} ({label})"
        results[f"{name} returns"] = statistics.median(returned)
        results[f"{name} state free"] = statistics.median(free)
        results[f"{name} -> written"] = statistics.median(done)
    clean()
    return label


def torch_checkpointing(tensors: dict, work: Path, runs: int, results: dict[str, float]) -> None:
    """torch-checkpointing's CheckpointManager (its defaults: async staging, shared memory, a
    background write process) saving to ``work`` and loading back into preallocated tensors."""
    import torch
    from torch_checkpointing import CheckpointManager

    base = work / "tckpting"
    manager = CheckpointManager()
    counter = itertools.count()
    returned, free, done = [], [], []
    last = None
    try:
        for i in range(runs + 1):
            shutil.rmtree(base, ignore_errors=True)
            last = str(base / str(next(counter)))
            t0 = time.perf_counter()
            fut = manager.save(last, {"state": tensors})
            r = time.perf_counter() - t0
            with manager.lock():  # returns once the staging copy is done
                f = time.perf_counter() - t0
            if fut is not None:
                fut.result()
            if i:
                returned.append(r)
                free.append(f)
                done.append(time.perf_counter() - t0)
        results["torch-checkpointing save() returns"] = statistics.median(returned)
        results["torch-checkpointing save() state free"] = statistics.median(free)
        results["torch-checkpointing save -> written"] = statistics.median(done)
        target = {k: torch.empty_like(v) for k, v in tensors.items()}
        first = next(iter(tensors))
        loads = []
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            got = manager.load(last, into={"state": target})
            loads.append(time.perf_counter() - t0)
            assert torch.equal(got["state"][first][:16], tensors[first][:16])
        results["torch-checkpointing load"] = statistics.median(loads[1:])
    finally:
        manager.close()
        shutil.rmtree(base, ignore_errors=True)
