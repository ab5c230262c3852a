"""Incremental and compressed persistent checkpoints, on real training state (CPU, no downloads).

Trains examples/train.py's TinyLM (d_model 256, 4 layers, vocab 512) for --steps steps, then, in
one run:

1. codec table: compression ratio and single-core (the process pinned to one CPU)
   compress/decompress throughput of our codec (``tierckptd.persistent.compress`` as ``auto``
   picks it per dtype, per 8 MiB chunk, framing and copies included) vs ZipNN vs plain zstd
   level 3 vs our previous codec (bg-zstd), all on the same 8 MiB chunks of the model as bf16
   and fp32 and of the AdamW moments (fp32); the codecs take turns on every chunk, --reps times
   (the machine is shared), and each chunk counts with its best time. Every codec's output is
   checked to decode to the input. ZipNN rewrites the buffer it compresses, so every coder is
   handed a fresh copy of each chunk (outside the timing; ours is told it may consume it, as the
   tier's drain does).
2. frozen-base fine-tune: the base (every parameter but the head and the last LayerNorm, ~89%
   of the saved bytes) is frozen, a new AdamW trains the rest; model + AdamW state are saved at
   three steps --ft-steps apart, one shard per tensor as tierckpt.torch lays them out (small
   tensors packed, a pickled skeleton), through the in-process tier (tests/persistent/rig.py,
   content layout, auto codec): stored bytes uploaded by each later step / step 1's. Then step
   1's manifest is deleted, chunks collected, and steps 2 and 3 restored byte-exact.
3. full pretraining steps: the trained model + AdamW state, then the same one training step
   later (everything changed), drained as steps 1 and 2 of a rank through one tier to a real
   moto_server with today's default layout (per-shard, raw), with the content layout and no
   codec, and with the content layout + auto codec, alternating, --drains times each (best and
   median): wall time of each step from the local commit until its manifest is stored. Once over loopback
   (requests cost, bytes are free), once through bench/_throttle.py at --rate MiB/s each way
   (a node's share of object-store bandwidth).

Command: PYTHONPATH=client:daemon:examples .venv/bin/python bench/incremental.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import zipnn
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests"), str(ROOT)]
import train  # noqa: E402
from tierckpt import torch as tt  # noqa: E402
from tierckpt._buffers import as_buffer  # noqa: E402
from tierckptd.backends import open_backend  # noqa: E402
from tierckptd.fakes import MemoryBackend  # noqa: E402
from tierckptd.knobs import KNOBS  # noqa: E402
from tierckptd.persistent import PersistentTier, compress, manifest_key  # noqa: E402
from tierckptd.persistent.calls import BackendCalls  # noqa: E402
from tierckptd.persistent.gc import collect  # noqa: E402

Shards = dict[str, tuple[bytes, str]]  # shard name -> (bytes, manifest dtype string)
Coder = tuple[Callable[[bytearray], Any], Callable[[Any, int], Any]]  # encode (may destroy its input), decode


def _model(steps: int) -> tuple[Any, Any, Any, Any, argparse.Namespace]:
    # the schedule has room for one more step (the full-step drain's second state)
    args = train.parse_args(["--steps", str(steps + 1), "--d-model", "256", "--layers", "4", "--vocab", "512"])
    model, opt, sched, data = train.build(args)
    for _ in range(steps):
        train.train_step(model, opt, sched, data, args.vocab)
    return model, opt, sched, data, args


def _tensors(model: Any, opt: Any) -> dict[str, tuple[bytes, str]]:
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    params = flat(model.parameters())
    moments = [opt.state[p] for p in model.parameters()]
    return {"weights bf16": (params.bfloat16().view(torch.uint16).numpy().tobytes(), "bfloat16"),
            "weights fp32": (params.numpy().tobytes(), "float32"),
            "adam exp_avg fp32": (flat(m["exp_avg"] for m in moments).numpy().tobytes(), "float32"),
            "adam exp_avg_sq fp32": (flat(m["exp_avg_sq"] for m in moments).numpy().tobytes(), "float32")}


# ----------------------------------------------------------------------------------- 1. codecs

def _coders(dtype: str) -> dict[str, Coder]:
    ours, old = compress.choose("auto", dtype), compress.choose("bg-zstd", dtype)
    z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte")
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    return {f"**ours** ({ours})": (lambda p: compress.encode(ours, p, consume=True),  # as the tier calls it
                                   lambda e, n: compress.decode(ours, e, n)),
            "zipnn": (z.compress, lambda e, n: z.decompress(e)),
            "zstd -3": (zc.compress, lambda e, n: zd.decompress(e, max_output_size=n)),
            f"before ({old})": (lambda p: compress.encode(old, p), lambda e, n: compress.decode(old, e, n))}


def _best(reps: int, parts: list[bytes], coders: dict[str, Coder]) -> dict[str, tuple[int, float, float]]:
    """{codec: (stored bytes, compress s, decompress s)}: the sum over chunks of each chunk's best
    time of ``reps``, the coders taking turns on every chunk (load spikes hit them alike)."""
    stored = {label: [enc(bytearray(p)) for p in parts] for label, (enc, _) in coders.items()}
    for label, (_, dec) in coders.items():
        assert all(bytes(dec(e, len(p))) == p for e, p in zip(stored[label], parts)), f"{label} is not lossless"
    total = {label: [0.0, 0.0] for label in coders}
    for i, part in enumerate(parts):
        best = {label: [float("inf"), float("inf")] for label in coders}
        for _ in range(reps):
            for label, (enc, dec) in coders.items():
                mine = bytearray(part)  # a fresh copy each time (ZipNN rewrites its input)
                t0 = time.perf_counter()
                enc(mine)
                t1 = time.perf_counter()
                dec(stored[label][i], len(part))
                t2 = time.perf_counter()
                best[label] = [min(best[label][0], t1 - t0), min(best[label][1], t2 - t1)]
        for label in coders:
            total[label] = [total[label][0] + best[label][0], total[label][1] + best[label][1]]
    return {label: (sum(map(len, stored[label])), *total[label]) for label in coders}  # type: ignore[misc]


def codec_table(tensors: dict[str, tuple[bytes, str]], reps: int) -> None:
    cpu = min(os.sched_getaffinity(0))
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    step = KNOBS.chunk_bytes
    print(f"## codecs (pinned to CPU {cpu}, {step >> 20} MiB chunks, each chunk's best of {reps}, codecs in turn)\n")
    print("| tensors | MB | codec | ratio | compress MB/s | decompress MB/s |\n|---|---|---|---|---|---|")
    summary = []
    try:
        for name, (data, dtype) in tensors.items():
            parts = [data[i:i + step] for i in range(0, len(data), step)]
            res, mb = _best(reps, parts, _coders(dtype)), len(data) / 1e6
            rows = {label: (len(data) / r[0], mb / r[1], mb / r[2]) for label, r in res.items()}
            for label, (ratio, c, d) in rows.items():
                print(f"| {name} | {mb:.1f} | {label} | {ratio:.3f} | {c:.0f} | {d:.0f} |")
            ours, zn = next(iter(rows.values())), rows["zipnn"]
            summary.append(f"| {name} | {ours[0] / zn[0]:.3f} | {ours[1] / zn[1]:.2f} | {ours[2] / zn[2]:.2f} |")
    finally:
        os.sched_setaffinity(0, was)
    print("\n| tensors | ratio ours/zipnn | compress ours/zipnn | decompress ours/zipnn |\n|---|---|---|---|")
    print("\n".join(summary))


# --------------------------------------------------------------------------------- 2. fine-tune

def _shards(state: dict[str, Any]) -> Shards:
    """The shards tierckpt.torch's Checkpointer.save makes of ``state`` (and their dtypes)."""
    import pickle

    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = {k: tt._split(tt._state_of(v), str(k), tensors, {}) for k, v in state.items()}
    taken: set[str] = set()
    names = [tt.shard_name(p, taken) for p, _ in tensors]
    shards, locs = tt.pack_tensors(list(zip(names, [t.detach().contiguous() for _, t in tensors])), 64 << 10)
    shards[tt.OBJECTS_SHARD] = pickle.dumps({"format": tt.FORMAT, "state": skeleton, "tensors": locs},
                                            protocol=pickle.HIGHEST_PROTOCOL)
    out = {}
    for name, obj in shards.items():
        buf = as_buffer(name, obj) if not isinstance(obj, bytes) else None
        out[name] = (bytes(buf.view), buf.dtype) if buf else (obj, "")
    return out


def _finetune_states(model: Any, data: Any, args: argparse.Namespace, every: int) -> dict[int, Shards]:
    trainable = {id(p) for p in (*model.head.parameters(), *model.ln.parameters())}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    states = {}
    for step in (1, 2, 3):
        for _ in range(every):
            train.train_step(model, opt, sched, data, args.vocab)
        states[step] = _shards({"model": model, "optim": opt})
    return states


def _rig(root: Path, node: str, memory: MemoryBackend | None = None) -> Any:
    from persistent.rig import Rig  # the in-process tier of the unit tests

    return Rig(root, node_id=node, memory=memory)


async def _restores_exactly(memory: MemoryBackend, root: Path, step: int, want: Shards) -> bool:
    reader = _rig(root, f"r{step}", memory)
    await reader.tier.start()
    local = await reader.tier.fetch("job", step, 0)
    exact = all(reader.store.shard_path(local, n).read_bytes() == b for n, (b, _) in want.items())
    await reader.tier.stop(1.0)
    return exact


async def finetune(states: dict[int, Shards], root: Path) -> None:
    raw = sum(len(b) for b, _ in states[1].values())
    frozen = sum(len(b) for n, (b, _) in states[1].items() if states[2][n][0] == b and states[3][n][0] == b)
    rig = _rig(root, "w")
    await rig.tier.start()
    sent = []
    for step, shards in states.items():
        before = rig.tier.content.sent
        rig.save("job", step, 0, {n: b for n, (b, _) in shards.items()}, dtypes={n: d for n, (_, d) in shards.items()})
        await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 600)
        sent.append(rig.tier.content.sent - before)
    await rig.tier.stop(1.0)
    memory = MemoryBackend(objects=rig.memory.objects)
    memory.delete([manifest_key("job", 1, 0, 1)])
    swept = await collect(BackendCalls(backend=memory), "job")
    exact = {s: await _restores_exactly(memory, root, s, states[s]) for s in (2, 3)}
    print(f"\n## frozen-base fine-tune\n\n{len(states[1])} shards, {raw / 1e6:.2f} MB raw per step, "
          f"{100 * frozen / raw:.1f}% of it unchanged between saves (frozen base)\n")
    print("| step | stored bytes uploaded | / step 1's stored | / raw bytes of a step |\n|---|---|---|---|")
    for step, n in zip(states, sent):
        print(f"| {step} | {n / 1e6:.3f} MB | {100 * n / sent[0]:.1f}% | {100 * n / raw:.1f}% |")
    print(f"\nafter deleting step 1's manifest: {swept} chunks collected; byte-exact restore: "
          + ", ".join(f"step {s} {ok}" for s, ok in exact.items()))


# ----------------------------------------------------------------------------- 3. full step

async def _drain_steps(url: str, layout: str, states: list[Shards], root: Path, codec: str) -> list[float]:
    """Drain ``states`` as steps 1, 2, ... of one rank through one tier: each drain's wall time."""
    rig = _rig(root, "n0")
    config = dataclasses.replace(rig.config, persistent=url, persistent_layout=layout, codec=codec)
    rig.tier = PersistentTier(config, rig.store, backend=open_backend(url))
    rig.tier.bind(rig.host)
    await rig.tier.start()
    took = []
    for step, shards in enumerate(states, 1):
        t = time.perf_counter()
        rig.save("job", step, 0, {n: b for n, (b, _) in shards.items()}, dtypes={n: d for n, (_, d) in shards.items()})
        await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 600)
        took.append(time.perf_counter() - t)
    await rig.tier.stop(1.0)
    return took


@contextlib.contextmanager
def _throttled(endpoint: str, rate_mib: float) -> Iterator[str]:
    """bench/_throttle.py in front of ``endpoint`` at ``rate_mib`` MiB/s each way; yields its URL."""
    proxy = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_throttle.py"), "--target",
                              endpoint.removeprefix("http://"), "--rate", str(int(rate_mib * (1 << 20)))],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = proxy.stdout.readline() if proxy.stdout else ""
        if not line.startswith("listening "):
            raise RuntimeError("bench/_throttle.py did not start")
        yield "http://" + line.split()[1]
    finally:
        proxy.terminate()
        proxy.wait(10)


ARMS = {"per-shard, raw (today's default)": ("per-shard", "none"), "content, no codec": ("content", "none"),
        "content + auto codec": ("content", "auto")}


def _drains(bucket: str, states: list[Shards], root: Path, drains: int, tag: str) -> dict[str, list[list[float]]]:
    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    with KNOBS.overridden(per_shard_layout=0):
        for i in range(drains):
            for j, (arm, (layout, codec)) in enumerate(ARMS.items()):
                url, where = f"s3://{bucket}/{tag}-{j}-{i}", root / f"{tag}{j}-{i}"
                times[arm].append(asyncio.run(_drain_steps(url, layout, states, where, codec)))
    return times


def full_step(states: list[Shards], root: Path, drains: int, rate_mib: float) -> None:
    from servers import MotoServer

    (root / "moto").mkdir(parents=True)
    server = MotoServer(root / "moto")
    server.start()
    results = {}
    try:
        os.environ.update(server.env)
        bucket = server.create_bucket()
        results["loopback"] = _drains(bucket, states, root, drains, "direct")
        if rate_mib:
            with _throttled(server.endpoint_url, rate_mib) as url:
                os.environ["AWS_ENDPOINT_URL"] = url
                results[f"{rate_mib:g} MiB/s"] = _drains(bucket, states, root, drains, "slow")
    finally:
        server.stop()
    raw = sum(len(b) for b, _ in states[-1].values())
    print(f"\n## full pretraining steps to moto_server ({len(states[-1])} shards, {raw / 1e6:.1f} MB a step, "
          f"{drains} runs per arm, arms alternating)\n")
    print("Step 1: a tier's first drain of the rank; step 2: the next step, everything changed.\n")
    print("| link | arm | step 1 median s | step 2 best s | step 2 median s | step 2 best / raw's "
          "| step 2 median / raw's |\n|---|---|---|---|---|---|---|")
    for link, times in results.items():
        base = [t[-1] for t in next(iter(times.values()))]
        for arm, runs in times.items():
            first, last = statistics.median(t[0] for t in runs), [t[-1] for t in runs]
            print(f"| {link} | {arm} | {first:.3f} | {min(last):.3f} | {statistics.median(last):.3f} "
                  f"| {min(last) / min(base):.2f}x | {statistics.median(last) / statistics.median(base):.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60, help="pretraining steps")
    p.add_argument("--ft-steps", type=int, default=5, help="fine-tune steps between saves")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--drains", type=int, default=9)
    p.add_argument("--rate", type=float, default=100.0, help="MiB/s of the throttled drain (0: none)")
    args = p.parse_args()
    model, opt, sched, data, targs = _model(args.steps)
    codec_table(_tensors(model, opt), args.reps)
    full = [_shards({"model": model, "optim": opt})]
    train.train_step(model, opt, sched, data, targs.vocab)  # one more step: every byte changes
    full.append(_shards({"model": model, "optim": opt}))
    with tempfile.TemporaryDirectory(prefix="tck-incremental-") as tmp:
        asyncio.run(finetune(_finetune_states(model, data, targs, args.ft_steps), Path(tmp) / "ft"))
        full_step(full, Path(tmp), args.drains, args.rate)


if __name__ == "__main__":
    main()
