"""How faithfully :class:`executor.emulation.Slowdown` emulates a slower device.

    python -m testbeds.emulation_fidelity                   # the benchmark's two jobs
    python -m testbeds.emulation_fidelity --factors 3,25 --out testbeds/results/emulation-fidelity

An emulated device ``k`` times slower should compute a forward or a backward in ``k`` times
the wall time this machine takes. :meth:`Slowdown.attach` (the DDP and GPipe baselines)
stretches each forward as one piece and the backward in pieces, each by a sleep; after a
sleep the next piece computes slower on a cold core (the pause cost,
:mod:`testbeds.pause_cost`), and the stretch multiplies that too. This probe times, for each
job's model on one thread and each factor, the plain forward and backward and the emulated
ones side by side (plain, emulated, plain again: the machine's drift lands on both), with
the backward cut per parameter (the rule before ``MIN_PIECE_S``) and at ``MIN_PIECE_S``.
A ratio of 1.00 is a faithful emulation; above 1, the emulated device is slower than its
factor says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fusion.config import JobSpec, load_job
from fusion.errors import FusionError
from testbeds.emulation import MIN_PIECE_S, Slowdown

RESULTS = Path(__file__).resolve().parent / "results"
JOBS = (RESULTS / "bench-job-gpt2.toml", RESULTS / "bench-job-resnet.toml")
#: The slowdowns the benchmark's topologies emulate, from the mildest to the CPU-only host.
FACTORS = (1.393, 3.182, 25.4)


def time_passes(
    model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median wall seconds of a forward (to the loss) and of its backward, after two warm-ups."""
    for _ in range(2):
        step(model).backward()
    forward, backward = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step(model)
        t1 = time.perf_counter()
        loss.backward()
        forward.append(t1 - t0)
        backward.append(time.perf_counter() - t1)
    return statistics.median(forward), statistics.median(backward)


def measure_job(
    job: JobSpec, factors: Sequence[float], *, repeats: int = 5, pieces: Sequence[float] = (0.0, MIN_PIECE_S)
) -> list[dict[str, Any]]:
    """One row per factor and backward piece rule: plain and emulated seconds, and their ratio
    to ``factor`` times plain."""
    from fusion.losses import get_loss
    from fusion.training import build_job_dataset, build_job_model, example_micro_batch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the testbeds run every rank
    try:
        x, y = example_micro_batch(job, build_job_dataset(job))
        loss_fn = get_loss(job.train.loss)

        def step(model: torch.nn.Module) -> torch.Tensor:
            return loss_fn(model(x), y)

        plain_model = build_job_model(job)
        rows = []
        for factor in factors:
            for piece in pieces:
                emulated_model = build_job_model(job)
                Slowdown(factor, min_piece_s=piece).attach(emulated_model)
                before = time_passes(plain_model, step, repeats)
                emulated = time_passes(emulated_model, step, repeats)
                after = time_passes(plain_model, step, repeats)
                plain = ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
                rows.append(
                    {
                        "job": job.name,
                        "factor": factor,
                        "min_piece_s": piece,
                        "plain_forward_s": plain[0],
                        "plain_backward_s": plain[1],
                        "emulated_forward_s": emulated[0],
                        "emulated_backward_s": emulated[1],
                        "forward_ratio": emulated[0] / (factor * plain[0]),
                        "backward_ratio": emulated[1] / (factor * plain[1]),
                    }
                )
        return rows
    finally:
        torch.set_num_threads(threads)


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Emulation fidelity",
        "",
        f"`{command}`",
        "",
        "Wall time of an emulated forward / backward over `factor` times the plain one on this machine "
        "(one thread, medians; 1.00 is faithful). `piece`: the backward is stretched per parameter (0) "
        "or in pieces of at least that much compute (`executor.emulation.MIN_PIECE_S`).",
        "",
        "| job | factor | piece | plain fwd ms | plain bwd ms | emulated fwd ms | emulated bwd ms | fwd ratio | bwd ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        piece = "per parameter" if r["min_piece_s"] == 0 else f"{r['min_piece_s'] * 1e3:g} ms"
        lines.append(
            f"| {r['job']} | {r['factor']:g} | {piece} | "
            f"{r['plain_forward_s'] * 1e3:.1f} | {r['plain_backward_s'] * 1e3:.1f} | {r['emulated_forward_s'] * 1e3:.1f} | "
            f"{r['emulated_backward_s'] * 1e3:.1f} | {r['forward_ratio']:.2f} | {r['backward_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.emulation_fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--jobs",
        default=",".join(str(j) for j in JOBS),
        help="comma-separated job files (default: the benchmark's two)",
    )
    p.add_argument(
        "--factors",
        default=",".join(f"{f:g}" for f in FACTORS),
        help="comma-separated slowdowns (default: %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed passes per measurement (default: %(default)s)")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    try:
        factors = [float(f) for f in args.factors.split(",") if f]
    except ValueError as e:
        print(f"error: --factors takes numbers: {e}", file=sys.stderr)
        return 2
    try:
        jobs = [load_job(j) for j in args.jobs.split(",") if j]
    except (FusionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1 or any(f < 1 for f in factors):
        print("error: --repeats must be >= 1 and every factor >= 1", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for job in jobs:
        print(f"timing {job.name} ...", file=sys.stderr, flush=True)
        rows += measure_job(job, factors, repeats=args.repeats)
    text = markdown(
        rows, "python -m testbeds.emulation_fidelity " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    print(text, end="")
    if args.out:
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
