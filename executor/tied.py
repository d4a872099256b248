"""Parameters held by several stages (tied weights, e.g. GPT-2's token embedding on the
first stage and its output head on the last).

Each holder computes a gradient for its own uses; all must step with the sum, or the
copies drift apart. After a step the holders send each other their gradient directly
(``SyncTied``, :meth:`executor.runtime.StageRuntime.sync_tied`) and each adds them in
stage order, so every copy gets the same numbers added in the same order and stays
bit-identical. This module holds one stage's view: which parameters it shares with whom,
what an incoming tied transfer must look like, and the sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from executor.mailbox import ExpectedValue, Payload
from fusion.errors import WireError
from fusion.wire import tensor_pb2 as pb


@dataclass(frozen=True)
class TiedParam:
    """A parameter this stage shares with others."""

    name: str
    """Its name in this stage's module."""
    canonical: str
    """The name every holder knows it by (tied gradients travel under it)."""
    holders: tuple[int, ...]
    """Every holding stage, this one included, ascending: the order of the sum."""


class TiedSet:
    """The tied parameters of one stage (validated against its module's parameters)."""

    def __init__(self, stage_idx: int, params: Mapping[str, torch.nn.Parameter], tied: Sequence[TiedParam]) -> None:
        for t in tied:
            if t.name not in params:
                raise WireError(f"stage {stage_idx} holds no parameter {t.name!r} to tie")
            if stage_idx not in t.holders or len(t.holders) < 2 or list(t.holders) != sorted(set(t.holders)):
                raise WireError(
                    f"tied parameter {t.canonical!r}: holders {list(t.holders)} must be ascending, distinct, "
                    f"include stage {stage_idx} and another"
                )
        if len({t.canonical for t in tied}) != len(tied):
            raise WireError(f"stage {stage_idx} names a tied parameter twice")
        self.stage_idx = stage_idx
        self.params = {t.name: params[t.name] for t in tied}
        self.tied = list(tied)

    def shared_with(self, peer: int) -> list[TiedParam]:
        """The tied parameters this stage shares with stage ``peer``."""
        return [t for t in self.tied if peer in t.holders and peer != self.stage_idx]

    def peers(self) -> list[int]:
        """The other stages holding any of these parameters, ascending."""
        return sorted({h for t in self.tied for h in t.holders if h != self.stage_idx})

    def check_transfer(self, header: pb.TransferHeader) -> None:
        """A tied-gradient transfer: from a co-holder, exactly the parameters shared with
        it, each shaped and typed like this stage's copy (checked before the payload is read)."""
        src = header.src_stage_idx
        shared = {t.canonical: t for t in self.shared_with(src)}
        if not shared:
            raise WireError(f"stage {self.stage_idx} shares no tied parameter with stage {src}")
        if header.values:
            raise WireError("tied gradients are tensors; the transfer carries scalars")
        received = {m.name: m for m in header.tensors}
        if set(received) != set(shared):
            raise WireError(f"tied gradients from stage {src} must be exactly {sorted(shared)}, got {sorted(received)}")
        for name, meta in received.items():
            p = self.params[shared[name].name]
            ExpectedValue(kind="tensor", dtype=p.dtype, shape=tuple(p.shape)).check(name, meta, None)

    def own_gradients(self) -> dict[str, torch.Tensor]:
        """This stage's gradient of each tied parameter by canonical name (zeros where its
        uses got none)."""
        out = {}
        for t in self.tied:
            p = self.params[t.name]
            out[t.canonical] = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
        return out

    def set_sums(self, own: Mapping[str, torch.Tensor], received: Mapping[int, Payload]) -> None:
        """Set each tied parameter's gradient to the sum over its holders, in stage order."""
        with torch.no_grad():
            for t in self.tied:
                p = self.params[t.name]
                parts = [
                    own[t.canonical] if h == self.stage_idx else received[h][t.canonical].to(p.device)
                    for h in t.holders
                ]
                total = parts[0].clone()
                for g in parts[1:]:
                    total += g
                p.grad = total
