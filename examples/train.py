#!/usr/bin/env python
"""Train a small transformer language model on CPU, checkpointing through tierckpt.

Saves the whole training state (model, AdamW, LR schedule, RNG states, data-loader position) in
the local tier every ``--save-every`` steps and asks for the persistent tier every
``--persist-every`` steps; on start it resumes from ``latest()``. Training is deterministic: a run
that is killed and restarted reproduces the losses of an uninterrupted run exactly. A failed save
(daemon down, local tier full) is logged and counted, and training goes on, unless
``--raise-on-save-error``.

    python examples/train.py --address unix:///tmp/d.sock --job demo --steps 200 \\
        --save-every 10 --persist-every 50 --log-json demo.jsonl

``--log-json FILE`` appends one JSON object per line: ``start``, ``restore`` (step, tier, seconds),
``step`` (step, loss, lr), ``save`` (step, persist, blocking_s), ``commit`` (step, ok, commit_s or
error) and ``end`` (save counters). A step number is the count of optimizer steps done: the
checkpoint of step s holds the state after s steps, and resuming from it runs step s+1 next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import sys
import threading
import time
from typing import Any

import numpy as np
import tierckpt
import torch
import torch.nn.functional as F
from tierckpt.torch import Checkpointer, RNGState
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("train")


# ---------------------------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with residual dropout."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Token + position embeddings, ``layers`` blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq_len: int, dropout: float,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.activation_checkpointing = activation_checkpointing
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            # Recomputed in backward with the same RNG state (dropout masks match).
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training \
                else block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------- data


class MarkovBatches:
    """An endless stream of batches cut from a synthetic corpus (a sparse random Markov chain).

    The corpus is rebuilt from the seed; the position (a generator state and a batch count) is the
    checkpointed state.
    """

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int, corpus_len: int = 50_000) -> None:
        g = torch.Generator().manual_seed(seed)
        succ = torch.randint(0, vocab, (vocab, 4), generator=g)
        choice = torch.multinomial(torch.tensor([0.6, 0.25, 0.1, 0.05]), corpus_len, replacement=True, generator=g)
        table, tok, tokens = succ.tolist(), 0, []
        for c in choice.tolist():
            tok = table[tok][c]
            tokens.append(tok)
        corpus = torch.tensor(tokens, dtype=torch.long)
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.batches = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.corpus) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        rows = torch.stack([self.corpus[s : s + self.seq_len + 1] for s in starts.tolist()])
        self.batches += 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.gen.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["generator"])
        self.batches = state["batches"]


# ---------------------------------------------------------------------------------------------- logging


_print_lock = threading.Lock()


def say(rank: int, text: str) -> None:
    """One whole line to stdout (the commit callbacks print from another thread)."""
    with _print_lock:
        sys.stdout.write(f"[rank{rank}] {text}\n")
        sys.stdout.flush()


class JsonLog:
    """Appends one JSON object per line (thread-safe; flushed per line so a killed run keeps it)."""

    def __init__(self, path: str | None) -> None:
        self._fh = open(path, "a", encoding="utf-8") if path else None
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        line = json.dumps({"event": event, "t": time.time(), **fields})
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="daemon address (default $TIERCKPT_ADDRESS)")
    p.add_argument("--job", default="demo")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run")
    p.add_argument("--save-every", type=int, default=10, help="local checkpoint every k steps (0: never)")
    p.add_argument("--persist-every", type=int, default=50, help="persistent checkpoint every K steps (0: never)")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-init", default=None, metavar="URL",
                   help="join a gloo process group (e.g. tcp://127.0.0.1:29500) so the ranks agree on the step "
                        "to resume from before any of them saves")
    p.add_argument("--activation-checkpointing", action="store_true", help="torch.utils.checkpoint per block")
    p.add_argument("--raise-on-save-error", action="store_true", help="a failed save stops training")
    p.add_argument("--log-json", default=None, metavar="FILE", help="append JSON lines of events to FILE")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--stop-after", type=int, default=0, help="crash (exit 3, nothing flushed) after step N")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step, seconds (for demos)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[TinyLM, torch.optim.Optimizer, Any, MarkovBatches]:
    """Seed every RNG and build model, AdamW, one-cycle schedule and data (deterministic per rank)."""
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    seed = args.seed + args.rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len, args.dropout,
                   getattr(args, "activation_checkpointing", False))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 2), pct_start=0.1)
    return model, opt, sched, MarkovBatches(args.vocab, args.seq_len, args.batch_size, seed)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, data: MarkovBatches,
               vocab: int) -> tuple[torch.Tensor, int]:
    """One optimizer step; returns the loss and the number of tokens consumed."""
    x, y = data.next()
    loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss, x.numel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[rank{args.rank}] %(levelname)s %(name)s: %(message)s")
    jlog = JsonLog(args.log_json)
    jlog("start", job=args.job, rank=args.rank, world_size=args.world_size, pid=os.getpid())
    model, opt, sched, data = build(args)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": data,
             "extra": {"tokens_seen": 0}}

    if args.dist_init:
        # With a process group, latest() is a collective (tierckpt.agree): every rank gets the same
        # step, and none saves before all have asked. Without one, a rank that starts late could see
        # a step completed by the other ranks' new saves plus its own crashed run's save.
        torch.distributed.init_process_group("gloo", init_method=args.dist_init, rank=args.rank,
                                             world_size=args.world_size, timeout=datetime.timedelta(minutes=5))
    ckpt = Checkpointer(args.job, address=args.address, rank=args.rank, world_size=args.world_size,
                        raise_on_error=args.raise_on_save_error)
    latest = ckpt.latest()
    start = 0
    if latest is not None:
        got = ckpt.load(state, step=latest)
        start = got.step
        say(args.rank, f"restored step {got.step} from {got.tier} tier ({got.source_node}) "
              f"in {got.seconds * 1e3:.1f} ms")
        jlog("restore", step=got.step, tier=got.tier, source_node=got.source_node, seconds=got.seconds)
    else:
        say(args.rank, f"no checkpoint of {args.job}: starting at step 0")
        jlog("restore", step=None)

    model.train()
    for step in range(start + 1, args.steps + 1):
        loss, tokens = train_step(model, opt, sched, data, args.vocab)
        state["extra"]["tokens_seen"] += tokens
        lr = sched.get_last_lr()[0]
        jlog("step", step=step, loss=loss.item(), lr=lr)
        if args.log_every and step % args.log_every == 0:
            say(args.rank, f"step {step} loss {loss.item():.4f} lr {lr:.2e}")
        if args.save_every and step % args.save_every == 0:
            save(ckpt, jlog, step, state, args)
        if args.stop_after and step >= args.stop_after:
            say(args.rank, f"--stop-after {args.stop_after}: exiting abruptly")
            os._exit(3)
        if args.step_delay:
            time.sleep(args.step_delay)

    try:
        ckpt.wait()
    finally:
        stats = ckpt.stats
        jlog("end", started=stats.started, committed=stats.committed, failed=stats.failed)
        say(args.rank, f"done: {stats.committed} saves committed, {stats.failed} failed")
        ckpt.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def save(ckpt: Checkpointer, jlog: JsonLog, step: int, state: dict, args: argparse.Namespace) -> None:
    """Start one save and log its blocking time now and its commit (or failure) when it resolves."""
    persist = bool(args.persist_every) and step % args.persist_every == 0
    fut = ckpt.save(step, state, persist=persist, metadata={"seed": args.seed})
    blocking = fut.total_blocking_seconds
    say(args.rank, f"step {step} save{' (persist)' if persist else ''}: "
          f"blocked {blocking * 1e3:.1f} ms")
    jlog("save", step=step, persist=persist, blocking_s=blocking)

    def done(f: Any) -> None:
        err = f.exception()
        if err is None:
            res: tierckpt.SaveResult = f.result()
            jlog("commit", step=step, ok=True, commit_s=res.commit_seconds, nbytes=res.nbytes)
            say(args.rank, f"step {step} committed locally in {res.commit_seconds * 1e3:.1f} ms "
                  f"({res.nbytes / 1e6:.2f} MB)")
        else:
            jlog("commit", step=step, ok=False, error=repr(err))

    fut.add_done_callback(done)


if __name__ == "__main__":
    sys.exit(main())
