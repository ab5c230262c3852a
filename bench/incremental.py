"""Incremental and compressed persistent checkpoints, on real training state (CPU, no downloads).

Trains examples/train.py's TinyLM (d_model 256, 4 layers) for --steps steps, then:

1. codec table: compression ratio and single-core compress/decompress throughput of our codec
   (tierckptd.persistent.compress, per dtype) vs ZipNN vs plain zstd level 3, on the model as
   bf16 and fp32 and on the AdamW moments (fp32);
2. frozen-base fine-tune: the same state saved at two steps where only the head (~10% of the
   bytes) changed, drained in-process to a MemoryBackend: stored bytes uploaded by the second
   drain / a full step; then the old step's manifest is deleted, chunks collected, and the
   second step restored byte-exact.

Command: PYTHONPATH=client:daemon:examples .venv/bin/python bench/incremental.py --steps 60
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zipnn
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import train
from tierckptd.knobs import KNOBS
from tierckptd.persistent import compress, manifest_key
from tierckptd.persistent.calls import BackendCalls
from tierckptd.persistent.gc import collect


def _state(steps: int) -> dict[str, tuple[bytes, str]]:
    args = train.parse_args(["--steps", str(steps), "--d-model", "256", "--layers", "4", "--vocab", "512"])
    model, opt, sched, data = train.build(args)
    for _ in range(steps):
        train.train_step(model, opt, sched, data, args.vocab)
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    params = flat(model.parameters())
    moments = [opt.state[p] for p in model.parameters()]
    return {"weights bf16": (params.bfloat16().view(torch.uint16).numpy().tobytes(), "bfloat16"),
            "weights fp32": (params.numpy().tobytes(), "float32"),
            "adam exp_avg fp32": (flat(m["exp_avg"] for m in moments).numpy().tobytes(), "float32"),
            "adam exp_avg_sq fp32": (flat(m["exp_avg_sq"] for m in moments).numpy().tobytes(), "float32")}


def _time(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _ours(data: bytes, dtype: str) -> tuple[float, float, float]:
    codec, step = compress.choose("auto", dtype), KNOBS.chunk_bytes
    parts = [data[i:i + step] for i in range(0, len(data), step)]
    enc = [compress.encode(codec, p) for p in parts]
    assert b"".join(compress.decode(codec, e, len(p)) for e, p in zip(enc, parts)) == data
    return (len(data) / sum(map(len, enc)), _time(lambda: [compress.encode(codec, p) for p in parts]),
            _time(lambda: [compress.decode(codec, e, len(p)) for e, p in zip(enc, parts)]))


def _zipnn(data: bytes, dtype: str) -> tuple[float, float, float]:
    z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1, input_format="byte")
    enc = z.compress(data)
    return len(data) / len(enc), _time(lambda: z.compress(data)), _time(lambda: z.decompress(enc))


def _zstd(data: bytes, dtype: str) -> tuple[float, float, float]:
    c, d = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    enc = c.compress(data)
    return len(data) / len(enc), _time(lambda: c.compress(data)), _time(lambda: d.decompress(enc))


def codec_table(state: dict[str, tuple[bytes, str]]) -> None:
    torch.set_num_threads(1)
    print("| tensors | MB | codec | ratio | compress MB/s | decompress MB/s |\n|---|---|---|---|---|---|")
    for name, (data, dtype) in state.items():
        for label, fn in (("**ours**", _ours), ("zipnn", _zipnn), ("zstd -3", _zstd)):
            ratio, tc, td = fn(data, dtype)
            mb = len(data) / 1e6
            print(f"| {name} | {mb:.1f} | {label} | {ratio:.3f} | {mb / tc:.0f} | {mb / td:.0f} |")


async def _finetune(state: dict[str, tuple[bytes, str]], root: Path) -> None:
    from persistent.rig import Rig  # the in-process tier of the unit tests

    base = state["weights fp32"][0]
    head = len(base) // 10
    steps = {1: base, 2: base[:-head] + np.random.default_rng(1).bytes(head)}  # frozen base, new head
    rig = Rig(root)
    await rig.tier.start()
    sent = []
    for step, data in steps.items():
        before = rig.tier.content.sent
        rig.save("job", step, 0, {"model": data})
        await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 600)
        sent.append(rig.tier.content.sent - before)
    await rig.tier.stop(1.0)
    from tierckptd.fakes import MemoryBackend

    memory = MemoryBackend(objects=rig.memory.objects)
    memory.delete([manifest_key("job", 1, 0, 1)])
    swept = await collect(BackendCalls(backend=memory), "job")
    reader = Rig(root, node_id="r", memory=memory)
    await reader.tier.start()
    local = await reader.tier.fetch("job", 2, 0)
    exact = reader.store.shard_path(local, "model").read_bytes() == steps[2]
    await reader.tier.stop(1.0)
    print(f"\nfrozen-base fine-tune ({len(base) / 1e6:.1f} MB fp32, last 10% changed, random): step 1 uploaded "
          f"{sent[0] / 1e6:.2f} MB, step 2 uploaded {sent[1] / 1e6:.2f} MB = {100 * sent[1] / len(base):.1f}% "
          f"of a full step; {swept} chunks collected after deleting step 1; restore byte-exact: {exact}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    state = _state(args.steps)
    codec_table(state)
    with KNOBS.overridden(chunk_bytes=1 << 20), tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_finetune(state, Path(tmp)))


if __name__ == "__main__":
    main()
