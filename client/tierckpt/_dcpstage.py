"""An ``AsyncStager`` for ``dcp.async_save`` that does not stop the trainer (``tierckpt.dcp.Stager``).

``stage(state_dict)`` records, on the caller's thread, an event on each source GPU's current
stream (the saved bytes are those of that point) and returns a future at once; a background
thread makes a dedicated stream wait for the event and copies every tensor (a DTensor's local
shard) into host memory: CUDA tensors into pinned buffers from PyTorch's caching host allocator
(freed after the upload and reused by the next save: a reused pinned pool), CPU tensors into
plain copies. Tensors under ``small_below`` bytes (module buffers such as BatchNorm statistics,
which ``forward`` updates before any optimizer step) are first copied in ``stage()`` on their
device (on a GPU, a device-side copy on the current stream, ordered before the trainer's next
kernels). The future resolves to the staged state dict once every copy landed; ``async_save``
returns its ``staging_completion``. Like :class:`tierckpt.torch.Checkpointer`, the stager waits
for staging before the next optimizer step (a global pre-step hook), never in ``stage()``; call
:meth:`Stager.wait_staged` before other in-place writes to the saved tensors.

Unbound (``Stager()`` given to ``dcp.async_save`` with any writer), the host copies are the
stager's own: :class:`tierckpt.dcp.Writer` copies them into the local tier's staging files in the
upload thread (a second host copy, off the trainer's path). Bound to its Writer
(``Writer(job, step, stager=stager)``, passed to the same ``dcp.async_save``), ``stage()`` begins
the rank's save itself and copies each tensor straight into the staging mappings; ``write_data``
only commits it: one host copy, and nothing but the staging files held between saves (see
:mod:`tierckpt._dcpbound`). A bound Stager serves one save at a time: binding it to a second
Writer while the first one's save is in flight raises ``FailedPreconditionError``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from . import _dcpbound
from ._hooks import StagedWaiter
from ._tensorcopy import TensorCopier
from .errors import FailedPreconditionError, TierckptError

__all__ = ["Stager"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(_local(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, staged: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        local = staged[id(_local(obj))]
        if hasattr(obj, "_local_tensor"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(local, obj.device_mesh, obj.placements,  # type: ignore[attr-defined]
                                      run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        return local
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, staged) for v in obj]
    if isinstance(obj, tuple):
        return type(obj)(*[_rebuild(v, staged) for v in obj]) if hasattr(obj, "_fields") else \
            tuple(_rebuild(v, staged) for v in obj)
    return obj


class Stager(AsyncStager):
    """Asynchronous staging for ``dcp.async_save(..., async_stager=Stager())`` (see the module docstring).

    The stager never blocks ``stage()`` on a copy: ``should_synchronize_after_execute`` is False,
    and the next optimizer step waits for the staged copy. Call :meth:`close` after the last save.

    Args:
        small_below: tensors under this many bytes are copied in ``stage()`` (on their device).
        group: bound use only: the process group given to ``dcp.async_save`` (default: the world),
            whose rank and size the save is begun with in ``stage()``.
    """

    _synchronize_after_execute = False

    def __init__(self, small_below: int = 1 << 20, *, group: Any = None) -> None:
        self.small_below = small_below
        self.group = group
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-dcp-stage")
        self._waiter = StagedWaiter()
        self._streams: dict[torch.device, Any] = {}
        self._last: cf.Future | None = None
        self._lock = threading.Lock()
        self._writer: weakref.ref | None = None  # the bound tierckpt.dcp.Writer
        self._copier: TensorCopier | None = None  # bound saves: into the staging mappings

    def _bind(self, writer: Any) -> None:
        """Stage for ``writer`` from now on (``Writer(..., stager=self)``).

        Raises:
            FailedPreconditionError: bound to another Writer whose save is in flight.
        """
        with self._lock:
            cur = _dcpbound.bound_writer(self._writer)
            if cur is not None and cur is not writer and _dcpbound.busy(cur):
                raise FailedPreconditionError(
                    f"tierckpt.dcp.Stager is bound to the Writer of {cur.job} step {cur.step}, whose save is in "
                    "flight: a bound Stager serves one save at a time (wait for that save's future, or give each "
                    "concurrent save its own Stager; drop_staged() releases a staged save DCP will not write)")
            self._writer = weakref.ref(writer)

    @property
    def bound(self) -> bool:
        """Whether ``stage()`` stages into a Writer's staging files (see the module docstring)."""
        return _dcpbound.bound_writer(self._writer) is not None

    def stage(self, state_dict: dict[str, Any]) -> cf.Future:
        """A future of ``state_dict`` staged as of this call (copies made after it returned).

        Unbound: resolves to a host copy. Bound: resolves to ``state_dict`` itself once its bytes are
        in the bound Writer's staging files; a storage failure fails the future (and the save).
        """
        writer = _dcpbound.bound_writer(self._writer)
        fut = self._stage_bound(writer, state_dict) if writer is not None else self._stage_copy(state_dict)
        with self._lock:
            self._last = fut
        self._waiter.add(fut)
        return fut

    def _stage_bound(self, writer: Any, state_dict: dict[str, Any]) -> cf.Future:
        if writer._staged is not None:
            raise FailedPreconditionError(f"the Writer of {writer.job} step {writer.step} already holds a staged save "
                                          "DCP has not written (one Writer per save; drop_staged() releases it)")
        if self._copier is None:
            self._copier = TensorCopier()
        fut: cf.Future = cf.Future()
        try:
            staged = _dcpbound.stage_into(writer, state_dict, self._copier, self.small_below, self.group)
        except (TierckptError, OSError) as e:  # the save fails, the trainer goes on
            fut.set_exception(e)
            return fut
        writer._staged = staged

        def landed(f: cf.Future) -> None:
            err = f.exception()
            if err is not None:  # the save is aborted: DCP fails before write_data, the Writer is free
                if writer._staged is staged:
                    writer._staged = None
                fut.set_exception(err)
            else:
                fut.set_result(state_dict)

        staged.save.staged.add_done_callback(landed)
        return fut

    def drop_staged(self) -> None:
        """Abort the bound Writer's staged save that DCP will not write (its ``dcp.async_save``
        failed before ``write_data``), releasing the binding for the next Writer."""
        writer = _dcpbound.bound_writer(self._writer)
        staged = writer._staged if writer is not None else None
        if staged is not None:
            writer._staged = None
            staged.save.abort(FailedPreconditionError(f"{staged.job} step {staged.step}: the staged save was "
                                                      "dropped (Stager.drop_staged or close) before DCP wrote it"))

    def _stage_copy(self, state_dict: dict[str, Any]) -> cf.Future:
        found: list[torch.Tensor] = []
        _collect(state_dict, found)
        sources: dict[int, torch.Tensor] = {}  # id of the live tensor -> what the thread copies
        for t in found:
            small = t.numel() * t.element_size() < self.small_below
            sources[id(t)] = t.detach().clone(memory_format=torch.contiguous_format) if small else t.detach()
        devices = {t.device for t in sources.values() if t.device.type == "cuda"}
        marks = {d: torch.cuda.current_stream(d).record_event() for d in devices}
        return self._thread.submit(self._copy, state_dict, sources, marks)

    def _copy(self, state_dict: dict[str, Any], sources: dict[int, torch.Tensor], marks: dict) -> dict[str, Any]:
        staged: dict[int, torch.Tensor] = {}
        done = []
        for dev, mark in marks.items():
            side = self._streams.get(dev)
            if side is None:
                side = self._streams[dev] = torch.cuda.Stream(device=dev)
            side.wait_event(mark)
            with torch.cuda.stream(side):
                for key, t in sources.items():
                    if t.device == dev:
                        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        staged[key] = dst.copy_(t, non_blocking=True)
            done.append(side.record_event())
        for key, t in sources.items():
            if t.device.type != "cuda":
                staged[key] = t.clone(memory_format=torch.contiguous_format).cpu()
        for ev in done:
            ev.synchronize()
        return _rebuild(state_dict, staged)

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the states staged so far are copied (their tensors may change)."""
        return self._waiter.wait(timeout)

    def synchronize_staging(self) -> None:
        """Wait for the last ``stage()`` (DCP's older protocol)."""
        with self._lock:
            last = self._last
        if last is not None:
            cf.wait([last])

    def close(self) -> None:
        """Finish staging in flight; abort a staged save DCP has not written; remove the pre-step
        hook; unregister page-locked staging mappings."""
        self._thread.shutdown(wait=True)
        self.synchronize_staging()  # no copy into a staging mapping in flight when it is unregistered
        self.drop_staged()
        self._waiter.close()
        if self._copier is not None:
            self._copier.close()
