"""Lightning's Trainer with TierckptCheckpointIO: an interrupted, resumed run matches an uninterrupted one."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import pytorch_lightning as pl
import tierckpt
import torch
from tierckpt.lightning import TierckptCheckpointIO, read_pointer

STEPS_PER_EPOCH = 4


class Boom(RuntimeError):
    pass


class Regress(pl.LightningModule):
    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.crash_at = crash_at
        self.losses: dict[int, float] = {}

    def training_step(self, batch, _idx):
        if self.global_step == self.crash_at:
            raise Boom(f"interrupted at step {self.global_step}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS_PER_EPOCH * 8, 3, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def fit(tmp_path, daemon, job, *, crash_at=None, ckpt_path=None, epochs=4):
    pl.seed_everything(0, verbose=False)
    model = Regress(crash_at)
    io = TierckptCheckpointIO(job, address=daemon.address)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = pl.Trainer(max_epochs=epochs, plugins=[io], callbacks=[ckpt], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, num_sanity_val_steps=0)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Boom:
        pass
    return model, trainer


def test_interrupted_run_resumes_exactly(tmp_path, daemon):
    ref, _ = fit(tmp_path / "ref", daemon, "pl-ref")
    assert len(ref.losses) == 4 * STEPS_PER_EPOCH

    crashed, _ = fit(tmp_path, daemon, "pl-job", crash_at=2 * STEPS_PER_EPOCH + 1)  # in epoch 3
    assert sorted(crashed.losses) == list(range(2 * STEPS_PER_EPOCH + 1))
    last = tmp_path / "ckpt" / "last.ckpt"
    assert read_pointer(last) == {"job": "pl-job", "step": 2 * STEPS_PER_EPOCH, "epoch": 1}
    assert last.stat().st_size < 200  # a pointer; the state is in tierckpt
    kept = sorted(os.listdir(tmp_path / "ckpt"))
    assert kept == ["epoch=1-step=8.ckpt", "last.ckpt"]  # save_top_k=1 removed epoch 0's pointer

    resumed, trainer = fit(tmp_path, daemon, "pl-job", ckpt_path="last")
    assert min(resumed.losses) == 2 * STEPS_PER_EPOCH  # training went on from the checkpoint
    for step, loss in resumed.losses.items():
        assert loss == ref.losses[step], step  # bit-identical to the uninterrupted run
    for a, b in zip(resumed.net.parameters(), ref.net.parameters()):
        assert torch.equal(a, b)
    assert trainer.global_step == 4 * STEPS_PER_EPOCH
    with tierckpt.Client(daemon.address) as c:
        assert 4 * STEPS_PER_EPOCH in [i.step for i in c.list("pl-job")]


def test_plain_ckpt_files_still_load(tmp_path, daemon):
    io = TierckptCheckpointIO("pl-plain", address=daemon.address)
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 5}, tmp_path / "a.ckpt")
    io.teardown()  # waits for the commit and the pointer
    assert json.loads((tmp_path / "a.ckpt").read_text())["tierckpt"]["step"] == 5
    got = io.load_checkpoint(tmp_path / "a.ckpt")
    got["state_dict"]["w"] += 1  # a private copy: writable, the store is untouched
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.zeros(2))
    clone = pickle.loads(pickle.dumps(io))  # spawn strategies pickle the plugin
    assert torch.equal(clone.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.zeros(2))
    clone.teardown()
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io.teardown()


class Sized(pl.LightningModule):
    """A module built from saved hyperparameters (what load_from_checkpoint must reproduce)."""

    def __init__(self, hidden: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_load_from_checkpoint_of_a_pointer(tmp_path, daemon):
    pl.seed_everything(0, verbose=False)
    model = Sized(hidden=6, lr=0.05)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=None)
    trainer = pl.Trainer(max_epochs=2, plugins=[TierckptCheckpointIO("pl-load", address=daemon.address)],
                         callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)
    trainer.fit(model)
    best = ckpt.best_model_path
    assert read_pointer(best)["job"] == "pl-load"
    with pytest.raises(Exception, match="(?i)unpickl|weights only|load"):  # Lightning reads the file itself
        Sized.load_from_checkpoint(best)

    got = tierckpt.lightning.load_from_checkpoint(Sized, best, address=daemon.address)
    assert isinstance(got, Sized) and got.hparams.hidden == 6 and got.hparams.lr == 0.05  # built from hparams
    for a, b in zip(got.parameters(), model.parameters()):
        assert torch.equal(a, b.cpu())
    placed: list[str] = []
    over = tierckpt.lightning.load_from_checkpoint(Sized, best, address=daemon.address, lr=0.5,
                                                   map_location=lambda storage, loc: placed.append(loc) or storage)
    assert over.hparams.lr == 0.5 and placed and set(placed) == {"cpu"}  # kwargs override; map_location applies
    with pytest.raises(RuntimeError, match="size mismatch"):  # strict state-dict loading, as Lightning's
        tierckpt.lightning.load_from_checkpoint(Sized, best, address=daemon.address, hidden=5)
    plain = tmp_path / "plain.ckpt"  # not a pointer: Lightning's own loader
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "pytorch-lightning_version": pl.__version__}, plain)
    assert tierckpt.lightning.load_from_checkpoint(Sized, plain, weights_only=False).hparams.hidden == 6
    with pytest.raises(FileNotFoundError):
        tierckpt.lightning.load_from_checkpoint(Sized, tmp_path / "none.ckpt", address=daemon.address)
