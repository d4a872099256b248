"""``python -m tests.support.hooked_executor``: ``python -m executor.server`` with test hooks.

The bare executor's flags, plus (tests only):

- ``--fault KIND[@STEP]``: its stages send corrupted tensors (:mod:`tests.support.fault`);
- ``--emulate-slowdown FACTOR`` and ``--emulation {wall,profile}``: the testbeds' emulated
  slower device (:class:`testbeds.worker.EmulatedDevice`); with ``profile``,
  ``--stage-seconds JSON`` gives each stage's profiled seconds, ``{"STAGE": [FORWARD_S,
  BACKWARD_S]}``, as the coordinator's ``GetProfile`` would (a stage not named has none).

For :class:`executor.local.LocalCluster` (``module="tests.support.hooked_executor"``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch

from executor.hooks import StageHooks, StageInfo
from executor.server import build_parser, serve
from testbeds.emulation import EMULATIONS, check_factor
from testbeds.worker import EmulatedDevice
from tests.support.fault import FAULT_HELP, Fault, FaultyStages


class HookChain(StageHooks):
    """Several hooks, called in order (compute contexts nested, the first outermost)."""

    def __init__(self, hooks: Sequence[StageHooks]) -> None:
        self.hooks = list(hooks)

    def stage_loaded(self, stage: StageInfo) -> None:
        for h in self.hooks:
            h.stage_loaded(stage)

    def compute(self, stage: StageInfo, kind: str, step: int, micro_batch_idx: int) -> AbstractContextManager[None]:
        return self._chained(stage, kind, step, micro_batch_idx)

    @contextmanager
    def _chained(self, stage: StageInfo, kind: str, step: int, micro_batch_idx: int) -> Iterator[None]:
        with ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.compute(stage, kind, step, micro_batch_idx))
            yield

    def outgoing(
        self, stage: StageInfo, kind: str, step: int, dst_stage_idx: int, tensors: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        for h in self.hooks:
            tensors = h.outgoing(stage, kind, step, dst_stage_idx, tensors)
        return tensors


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(prog="python -m tests.support.hooked_executor")
    parser.add_argument("--fault", default=None, metavar="FAULT", help=FAULT_HELP)
    parser.add_argument("--emulate-slowdown", type=float, default=1.0, metavar="FACTOR")
    parser.add_argument("--emulation", choices=EMULATIONS, default="wall")
    parser.add_argument("--stage-seconds", default="{}", metavar="JSON")
    args = parser.parse_args(argv)
    hooks: list[StageHooks] = []
    factor = check_factor(args.emulate_slowdown)
    if factor > 1.0:
        table = {int(k): (float(v[0]), float(v[1])) for k, v in json.loads(args.stage_seconds).items()}
        hooks.append(
            EmulatedDevice(
                factor, emulation=args.emulation, seconds=lambda stage: table.get(stage.stage_idx, (0.0, 0.0))
            )
        )
    fault = Fault.parse(args.fault)
    if fault is not None:
        hooks.append(FaultyStages(fault))
    return serve(args, hooks=HookChain(hooks))


if __name__ == "__main__":
    sys.exit(main())
