"""The pipelining baseline's own stage costs, measured on its own program.

The GPipe baseline does not run the model fusion profiles. ``torch.distributed.pipelining``
exports the model (``torch.export``) and runs each stage as an ATen-level graph module:
BatchNorm functionalised, its buffer updates copied back, views materialised. On the
benchmark's small models that program costs a different amount, and in a different
proportion between forward and backward, than the eager graph the node profile measures.
Measured on a 2-core testbed machine, one thread (``python -m testbeds.stage_profile``):

- ResNet-18 w16, five stages: forward 1.3-2.8x the eager nodes' share, backward 0.6-0.9x
  the stage's forward (1.3x in the eager model);
- GPT-2 mini, four stages: forward 1.7-1.9x, backward 0.9-1.0x the forward.

A diagnostic, not the simulator's price. Over two sets of the six benchmark cells
(2026-12-01, ``testbeds/results/bench-notes.md``), GPipe's step priced from these times was
within 10 % of the run in 8 of 12, priced from the node profile (each node's backward timed
on its own autograd nodes) in 10 of 12; the node profile was the closer in 8 cells (by up to
24 points, volunteers ResNet +49 % against +25 %), these times in 3 (by at most 4 points).
So the simulator prices GPipe from the node profile, and this tool says how the two
programs differ.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fusion.config import JobSpec, load_job
from fusion.errors import FusionError
from fusion.profiling import trimmed_mean

#: The stages are timed in turn, round after round, until the rounds have measured this
#: long. This VM switches between speeds ~1.7x apart every second or so (one stage timed
#: for 0.5 s at a time came out 1.0x or 1.7x at random), and a GPipe step on it lasts
#: seconds: a long window, shared by all stages, prices each at the mix of speeds a run sees.
MIN_TIME_S = 4.0
WARMUP_ROUNDS = 2
#: Share of the samples dropped at each end before averaging (preemptions, not speed).
TRIM = 0.1


class _StageInputs(torch.fx.Interpreter):
    """Runs the split program once, keeping each stage module's arguments."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.args: dict[str, tuple[Any, ...]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.args[str(target)] = args
        return super().call_module(target, args, kwargs)


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _time_once(
    module: torch.nn.Module, args: tuple[Any, ...], backward: Callable[[object], None]
) -> tuple[float, float]:
    """Forward and backward seconds of one stage on its recorded inputs."""
    inputs = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    t0 = time.perf_counter()
    out = module(*inputs)
    t1 = time.perf_counter()
    backward(out)
    t2 = time.perf_counter()
    module.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def profile_pipeline_stages(spec: JobSpec, num_stages: int) -> list[dict[str, float]]:
    """Forward and backward seconds of each GPipe stage for one micro-batch, split and built
    as :mod:`testbeds.baselines.pipelining` builds them, on one thread as its ranks run: the
    trimmed mean of the stages timed in turn for ``MIN_TIME_S``.

    The last stage's backward includes the job's loss. Returns one
    ``{"fwd_time_s", "bwd_time_s"}`` per stage.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    from fusion.losses import get_loss
    from fusion.training import build_job_dataset, build_job_model, example_micro_batch
    from testbeds.baselines.split import block_names, even_split_points

    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    torch.set_num_threads(1)
    try:
        model = build_job_model(spec)
        x, y = example_micro_batch(spec, build_job_dataset(spec))
        points = even_split_points(block_names(model), num_stages)
        pipe = pipeline(model, mb_args=(x,), split_spec={p: SplitPoint.BEGINNING for p in points})
        recorder = _StageInputs(pipe.split_gm)
        recorder.run(x)
        loss_fn = get_loss(spec.train.loss)
        runs: list[Callable[[], tuple[float, float]]] = []
        for i in range(num_stages):
            name = f"submod_pp_{i}"
            if name not in recorder.args:
                raise FusionError(f"the pipeline program has no stage {name}: split into {sorted(recorder.args)}")
            args = tuple(
                a.detach().requires_grad_(i > 0 and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in recorder.args[name]
            )

            def backward(out: object, last: bool = i == num_stages - 1) -> None:
                if last:
                    loss_fn(_tensors(out)[0], y).backward()
                    return
                outs = [t for t in _tensors(out) if t.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

            runs.append(functools.partial(_time_once, pipe.get_stage_module(i), args, backward))
        samples: list[list[tuple[float, float]]] = [[] for _ in runs]
        rounds, spent = 0, 0.0
        while rounds < WARMUP_ROUNDS + 3 or spent < MIN_TIME_S:
            for stage, run in enumerate(runs):
                fwd, bwd = run()
                if rounds >= WARMUP_ROUNDS:
                    samples[stage].append((fwd, bwd))
                    spent += fwd + bwd
            rounds += 1
        return [
            {
                "fwd_time_s": trimmed_mean([f for f, _ in got], TRIM),
                "bwd_time_s": trimmed_mean([b for _, b in got], TRIM),
            }
            for got in samples
        ]
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.stage_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job TOML (as bench --job takes it)")
    parser.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    args = parser.parse_args(argv)
    for i, s in enumerate(profile_pipeline_stages(load_job(args.job), args.stages)):
        print(
            f"stage {i}: forward {s['fwd_time_s'] * 1e3:.2f} ms, backward {s['bwd_time_s'] * 1e3:.2f} ms ({s['bwd_time_s'] / s['fwd_time_s']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
