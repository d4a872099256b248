"""Memory the data plane receives tensors into, reused once nothing refers to it any more.

A freshly allocated buffer costs a page fault and a page of zeroes per 4 KiB on first write:
receiving into new memory every time moves a large tensor at a fraction of what receiving
into memory already mapped does (a raw socket's reader reuses one buffer). Training sends
the same shapes every micro-batch, so buffers are kept by size and handed out again once
the tensors made from them are gone.

Whether a buffer is free is read from its reference count: a tensor made by
``torch.frombuffer`` (and every view of it, its storage, a numpy array over it) holds a
reference to the ``bytearray`` it was made from, and the pool holds exactly one. This is
CPython's reference counting, which is exact and immediate; a buffer is never handed out
while any tensor can still see it.
"""

from __future__ import annotations

import logging
import sys
import threading

import torch

logger = logging.getLogger(__name__)

#: Most bytes of receive buffers a pool keeps (free or in use) for reuse.
DEFAULT_POOL_BYTES = 1 << 30
#: Buffers smaller than this are not pooled: a fresh one costs little.
MIN_POOLED_BYTES = 256 << 10
#: References to a pooled buffer nobody else holds, as seen while scanning the pool: the
#: pool's list, the loop variable and ``sys.getrefcount``'s own argument.
_FREE_REFS = 3


class ReceiveBuffers:
    """Byte buffers by size; :meth:`tensor` gives a tensor over a free one (or a new one)."""

    def __init__(self, *, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._by_size: dict[int, list[bytearray]] = {}
        self._held_bytes = 0
        self._lock = threading.Lock()
        self.num_reused = 0

    def _free_one(self, nbytes: int) -> bytearray | None:
        for buf in self._by_size.get(nbytes, ()):
            if sys.getrefcount(buf) == _FREE_REFS:
                return buf
        return None

    def _evict(self, need: int) -> None:
        """Drop free buffers of other sizes until ``need`` more bytes fit."""
        for size, bufs in list(self._by_size.items()):
            for buf in list(bufs):
                if self._held_bytes + need <= self.max_bytes:
                    return
                if sys.getrefcount(buf) == _FREE_REFS + 1:  # + this loop's copy of the list
                    bufs.remove(buf)
                    self._held_bytes -= size
            if not bufs:
                del self._by_size[size]

    def buffer(self, nbytes: int) -> bytearray:
        """``nbytes`` of memory no live tensor (or view of it) uses; a tensor over it is made
        with ``torch.frombuffer``, which keeps it referenced for as long as the tensor lives."""
        if nbytes < MIN_POOLED_BYTES:
            return bytearray(nbytes)
        with self._lock:
            buf = self._free_one(nbytes)
            if buf is not None:
                self.num_reused += 1
                return buf
            buf = bytearray(nbytes)
            if self._held_bytes + nbytes > self.max_bytes:
                self._evict(nbytes)
            if self._held_bytes + nbytes <= self.max_bytes:
                self._by_size.setdefault(nbytes, []).append(buf)
                self._held_bytes += nbytes
            return buf

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` over memory no live tensor uses."""
        return torch.frombuffer(self.buffer(nbytes), dtype=torch.uint8)
