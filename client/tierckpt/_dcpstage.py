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

DCP plans the layout after staging, so the host copies cannot be the local tier's staging files
themselves: :class:`tierckpt.dcp.Writer` copies them there in the upload thread (a second host
copy, off the trainer's path; :class:`tierckpt.torch.Checkpointer` makes one).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ._hooks import StagedWaiter

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

    The stager never blocks ``stage()``: ``should_synchronize_after_execute`` is False, and the
    next optimizer step waits for the staged copy. Call :meth:`close` after the last save.
    """

    _synchronize_after_execute = False

    def __init__(self, small_below: int = 1 << 20) -> None:
        self.small_below = small_below
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-dcp-stage")
        self._waiter = StagedWaiter()
        self._streams: dict[torch.device, Any] = {}
        self._last: cf.Future | None = None
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> cf.Future:
        """A future of a host copy of ``state_dict``, made after this call returned."""
        found: list[torch.Tensor] = []
        _collect(state_dict, found)
        sources: dict[int, torch.Tensor] = {}  # id of the live tensor -> what the thread copies
        for t in found:
            small = t.numel() * t.element_size() < self.small_below
            sources[id(t)] = t.detach().clone(memory_format=torch.contiguous_format) if small else t.detach()
        devices = {t.device for t in sources.values() if t.device.type == "cuda"}
        marks = {d: torch.cuda.current_stream(d).record_event() for d in devices}
        fut = self._thread.submit(self._copy, state_dict, sources, marks)
        with self._lock:
            self._last = fut
        self._waiter.add(fut)
        return fut

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
        """Finish staging in flight; remove the pre-step hook."""
        self._thread.shutdown(wait=True)
        self._waiter.close()
