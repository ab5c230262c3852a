"""Hugging Face Trainer with TierckptCallback: a run interrupted, its folder lost, resumed from tierckpt."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers
from tierckpt.hf import TierckptCallback

MAX_STEPS = 8


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Boom(RuntimeError):
    pass


class CrashAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Boom(f"interrupted at step {state.global_step}")


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 4, generator=g)
    y = x.pow(2).sum(1)
    return [{"x": a, "labels": b} for a, b in zip(x, y)]


def trainer(out, callbacks) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=MAX_STEPS, per_device_train_batch_size=4, learning_rate=0.05,
        save_strategy="steps", save_steps=3, save_total_limit=1, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, disable_tqdm=True, dataloader_num_workers=0)
    transformers.set_seed(0)
    return transformers.Trainer(model=Tiny(), args=args, train_dataset=dataset(), callbacks=callbacks)


def losses(t: transformers.Trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in t.state.log_history if "loss" in e}


def test_resume_from_tierckpt_after_losing_the_folder(tmp_path, daemon):
    ref = trainer(tmp_path / "ref", [])
    ref.train()

    cb = TierckptCallback("hf-job", address=daemon.address)
    first = trainer(tmp_path / "run", [cb, CrashAt(5)])
    with pytest.raises(Boom):
        first.train()
    cb.wait()
    assert cb.saved == [3] and cb.failed == 0
    shutil.rmtree(tmp_path / "run")  # the node's disk is gone; tierckpt still has step 3

    cb2 = TierckptCallback("hf-job", address=daemon.address)
    path = cb2.restore(str(tmp_path / "run"))
    assert path == str(tmp_path / "run" / "checkpoint-3")
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(os.listdir(path))
    second = trainer(tmp_path / "run", [cb2])
    second.train(resume_from_checkpoint=path)
    assert sorted(cb2.saved) == [6, 8]
    assert losses(second) == losses(ref)  # steps 1-3 from the restored trainer_state.json, 4-8 trained again
    assert sorted(losses(second)) == list(range(1, MAX_STEPS + 1))
    for a, b in zip(second.model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)  # bit-identical to the uninterrupted run
    cb.close()
    cb2.close()


def test_fresh_start_and_failures_do_not_stop_training(tmp_path, daemon):
    cb = TierckptCallback("hf-none", address=daemon.address)
    assert cb.restore(str(tmp_path)) is None
    daemon.kill()
    t = trainer(tmp_path / "down", [cb])
    t.train()  # the daemon is down: every save fails, training finishes
    assert cb.failed == 3 and cb.saved == []
    assert os.path.isdir(tmp_path / "down" / f"checkpoint-{MAX_STEPS}")
    cb.close()
