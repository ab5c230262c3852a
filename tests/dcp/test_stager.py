"""tierckpt.dcp.Stager: dcp.async_save staging that returns before the copy, one process, real daemon.

- ``stage()`` returns before the copy (the staging thread is held) and the staged copy holds the
  bytes of ``stage()`` time even though the optimizer steps right after (the pre-step hook waits);
- a plain tensor, a nested dict and a non-tensor value round-trip through the Writer and Reader.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import tierckpt  # noqa: E402
import tierckpt.dcp as tdcp  # noqa: E402


def test_async_save_with_the_stager_saves_the_bytes_of_stage_time(daemon):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stager = tdcp.Stager()
    gate = threading.Event()
    held = stager._copy

    def slow_copy(*a):
        assert gate.wait(60)
        return held(*a)

    stager._copy = slow_copy
    with tierckpt.Client(daemon.address) as c:
        sd = {"model": model.state_dict(), "extra": {"epoch": 3, "t": torch.arange(5)}}
        resp = dcp.async_save(sd, storage_writer=tdcp.Writer("stg", 1, client=c), async_stager=stager, no_dist=True)
        staging = getattr(resp, "staging_completion", None)
        assert staging is not None and not staging.done()  # async_save returned before the copy
        stepped = threading.Event()

        def step() -> None:
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            stepped.set()

        trainer = threading.Thread(target=step)
        trainer.start()
        assert not stepped.wait(0.5), "the optimizer step ran before staging finished"
        gate.set()
        assert stepped.wait(30)
        trainer.join(30)
        resp.upload_completion.result(60)
        got = {"model": {k: torch.zeros_like(v) for k, v in before.items()},
               "extra": {"epoch": 0, "t": torch.zeros(5, dtype=torch.int64)}}
        dcp.load(got, storage_reader=tdcp.Reader("stg", 1, client=c), no_dist=True)
    stager.close()
    for k, v in before.items():
        assert torch.equal(got["model"][k], v), k
    assert not torch.equal(model.weight.detach(), before["weight"])
    assert got["extra"]["epoch"] == 3 and torch.equal(got["extra"]["t"], torch.arange(5))
