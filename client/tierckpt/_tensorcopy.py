"""The torch :class:`~tierckpt._staging.Copier`: tensors, on the CPU or a CUDA GPU, straight into
the local tier's staging mappings (one host copy).

CPU tensors are copied with ``np.copyto`` on the client's I/O threads. CUDA tensors:

1. ``mark`` (in ``save()``, on the trainer's thread) records an event on each source device's
   current stream: the saved bytes are those of that point of the trainer's work;
2. ``copy`` (on the client's staging thread) page-locks each staging mapping
   (``cudaHostRegister`` through ``torch.cuda.cudart()``), makes a dedicated copy stream wait for
   the event, enqueues ``copy_(non_blocking=True)`` from the tensor into the mapping on that
   stream, and waits for the copies. A mapping stays registered until the client unmaps it
   (:data:`tierckpt._transfer.UNMAP_HOOKS`): a save's own maps right after its commit or abort,
   the kept maps of recycled files (reused by the next saves, which then page-lock nothing) when
   they age out, the rest at :meth:`TensorCopier.close`. Where registration is refused,
   the copies go through a small pinned pool (two 64 MiB buffers, allocated once and reused by
   every save: double-buffered device-to-pinned copies, each chunk then copied into the mapping).

The trainer is never synchronized: it waits (for ``staged``) only before its next optimizer step
(:mod:`tierckpt._hooks`). The sources are referenced until the copies have completed, so the
caching allocator cannot hand their memory to another tensor meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import mmap
import threading
import weakref
from typing import Any

import numpy as np
import torch

from ._staging import Copier, copy_host
from ._transfer import UNMAP_HOOKS

__all__ = ["TensorCopier", "tensor_bytes"]

log = logging.getLogger(__name__)

POOL_CHUNK = 64 << 20
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context (as torch.cuda._pin_memory_utils)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any device)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    return tensor_bytes(t.detach()).numpy()


class TensorCopier(Copier):
    """Copies CPU and CUDA tensors into staging mappings (see the module docstring).

    Args:
        register: page-lock the staging mappings for the device-to-host copies (False: always
            the pinned pool).
    """

    def __init__(self, register: bool = True) -> None:
        self.register = register
        self.refused = not register  # set once cudaHostRegister refused a mapping: the pool from then on
        self._streams: dict[torch.device, Any] = {}
        self._pool: list[torch.Tensor] = []
        self._lock = threading.Lock()  # one save's CUDA copies at a time (the client stages in order anyway)
        self._locked: dict[int, tuple[mmap.mmap, int]] = {}  # id(map) -> (map, address): page-locked
        self._locked_lock = threading.Lock()
        self._hooked = False
        self._cudart = torch.cuda.cudart  # the CUDA runtime bindings (tests give a recording stand-in)

    def mark(self, sources: list[Any]) -> dict[torch.device, Any]:
        devices = {s.device for s in sources if isinstance(s, torch.Tensor) and s.device.type == "cuda"}
        return {d: torch.cuda.current_stream(d).record_event() for d in devices}

    def copy(self, mark: Any, pairs: list[tuple[Any, np.ndarray]], io: cf.Executor) -> None:
        on_gpu = [(s, d) for s, d in pairs if s.device.type == "cuda"]
        on_host = [(s, d) for s, d in pairs if s.device.type != "cuda"]
        with self._lock:
            pending = self._enqueue(mark, on_gpu) if on_gpu else None
            try:
                if on_host:
                    copy_host(on_host, io, _host_bytes)
            finally:
                if pending is not None:
                    self._complete(*pending)

    def host_copy(self, source: Any) -> memoryview:
        t = source.detach()
        return _host_bytes(t if t.device.type == "cpu" else t.cpu()).data

    # ------------------------------------------------------------------ CUDA

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def _enqueue(self, mark: dict, pairs: list[tuple[torch.Tensor, np.ndarray]]) -> tuple:
        """Enqueue the registered copies; returns what :meth:`_complete` waits for and undoes."""
        cudart = self._cudart()
        registered: list[int] = []  # page-locked for this copy only (not a staging map)
        done, unregistered = [], []
        try:
            for dev in {s.device for s, _ in pairs}:
                side = self._stream(dev)
                side.wait_event(mark[dev])
                with torch.cuda.stream(side):
                    for src, dst in pairs:
                        if src.device != dev:
                            continue
                        if not self.refused and self._page_locked(cudart, dst, registered):
                            torch.from_numpy(dst).copy_(tensor_bytes(src), non_blocking=True)
                        else:
                            unregistered.append((src, dst))
                done.append(side.record_event())
        except BaseException:
            for dev in {s.device for s, _ in pairs}:  # nothing may still be copying into a map that goes
                self._stream(dev).synchronize()
            self._unregister(cudart, registered)
            raise
        return cudart, registered, done, unregistered

    def _page_locked(self, cudart: Any, dst: np.ndarray, transient: list[int]) -> bool:
        """Whether ``dst`` is page-locked: registered by an earlier save (a kept map), or now."""
        mm = getattr(dst.base, "obj", None)  # np.frombuffer(map) -> memoryview -> the map
        if isinstance(mm, mmap.mmap):
            with self._locked_lock:
                if id(mm) in self._locked:
                    return True
        if not self._register(cudart, dst):
            return False
        if not isinstance(mm, mmap.mmap):
            transient.append(dst.ctypes.data)
            return True
        with self._locked_lock:
            self._locked[id(mm)] = (mm, dst.ctypes.data)
            if not self._hooked:
                ref = weakref.WeakMethod(self._unmapping)

                def hook(m: mmap.mmap) -> None:
                    f = ref()
                    if f is not None:
                        f(m)

                UNMAP_HOOKS.append(hook)
                self._hooked = True
        return True

    def _unmapping(self, mm: mmap.mmap) -> None:
        """A staging map is about to be unmapped: unregister it if this copier page-locked it."""
        with self._locked_lock:
            got = self._locked.pop(id(mm), None)
        if got is not None:
            self._unregister(self._cudart(), [got[1]])

    def close(self) -> None:
        """Unregister every mapping still page-locked (no copy may be in flight)."""
        with self._locked_lock:
            held, self._locked = list(self._locked.values()), {}
        if held:
            self._unregister(self._cudart(), [addr for _, addr in held])

    def _register(self, cudart: Any, dst: np.ndarray) -> bool:
        err = cudart.cudaHostRegister(dst.ctypes.data, dst.nbytes, _PORTABLE)
        if int(err) == 0:
            return True
        self.refused = True
        log.warning("cudaHostRegister refused a staging mapping (%s): device-to-host copies go through a "
                    "reused pinned pool from now on (one more host copy)", err)
        return False

    @staticmethod
    def _unregister(cudart: Any, ptrs: list[int]) -> None:
        for ptr in ptrs:
            err = cudart.cudaHostUnregister(ptr)
            if int(err) != 0:  # the mapping is unmapped after the commit either way
                log.warning("cudaHostUnregister of a staging mapping failed: %s", err)

    def _complete(self, cudart: Any, registered: list[int], done: list, unregistered: list) -> None:
        try:
            for ev in done:
                ev.synchronize()
            if unregistered:
                self._via_pool(unregistered)
        finally:
            self._unregister(cudart, registered)

    def _via_pool(self, pairs: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        """Double-buffered copies through two reused pinned chunks, then into the mappings."""
        if not self._pool:
            self._pool = [torch.empty(POOL_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        pending: list[tuple | None] = [None, None]

        def drain(k: int) -> None:
            item = pending[k]
            if item is not None:
                ev, dst, n = item
                ev.synchronize()
                np.copyto(dst, self._pool[k][:n].numpy())
                pending[k] = None

        i = 0
        for src, dst in pairs:
            side = self._stream(src.device)
            flat = tensor_bytes(src)
            with torch.cuda.stream(side):
                for off in range(0, dst.nbytes, POOL_CHUNK):
                    k, n = i % 2, min(POOL_CHUNK, dst.nbytes - off)
                    drain(k)
                    self._pool[k][:n].copy_(flat[off : off + n], non_blocking=True)
                    pending[k] = (side.record_event(), dst[off : off + n], n)
                    i += 1
        drain(0)
        drain(1)
