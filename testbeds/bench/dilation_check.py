"""``python -m testbeds.bench.dilation_check``: does time dilation make a one-machine pipeline
compute in parallel as separate devices would?

    python -m testbeds.bench.dilation_check --dilate 8 --ks 2,4,6 --json OUT.json

Two checks, on the real product (a coordinator and real worker processes per testbed, real
gRPC, the emulation through the executor's compute hook, the ``proxy`` backend's links):

- **pipelined speed-up**: an even ``k``-stage pipeline (``[plan] strategy = "uniform"`` over
  :func:`make_model`'s ``12`` equal blocks) on ``k`` hosts joined by fast links, dilated
  ``D`` times, against the same job on one host, dilated alike. ``M`` micro-batches over
  ``k`` stages of equal time ``c``: one host takes ``M k c`` a step, the pipeline
  ``(M + k - 1) c``, so the ideal speed-up is ``M k / (M + k - 1)``. Target: at least
  :data:`MIN_SPEEDUP_RATIO` of it for every ``k``.
- **dilation is transparent**: the one-host job's step time dilated (divided by ``D``) and
  undilated agree within :data:`MAX_ONE_HOST_GAP`.

Each step time is the trimmed mean of a run's steps after ``--warmup``, in the emulated
world's time (dilated runs: divided by ``D``; the JSON says ``"dilation": D``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion.errors import FusionError
from fusion.profiling import trimmed_mean
from scheduler.topology import Topology
from testbeds.dilation import check_dilation, dilation_label, undilate_s
from testbeds.net.backend import open_testbed
from testbeds.net.launch import TestbedRun

logger = logging.getLogger(__name__)

#: Blocks of :func:`make_model` (divisible by every ``k`` checked: 2, 3, 4, 6).
NUM_BLOCKS = 12
#: Pipelined speed-up, as a share of the ideal, that the check asks for.
MIN_SPEEDUP_RATIO = 0.8
#: Largest gap between the one-host step dilated and undilated, relative to undilated.
MAX_ONE_HOST_GAP = 0.10
#: The fast links between the hosts (before dilation).
FAST_LINK_MBPS = 10_000.0
FAST_LINK_LATENCY_MS = 0.05


class Block(nn.Module):
    """Two ``width x width`` layers with ReLUs: every block costs the same. The first block
    also flattens its input (``3 x s x s`` images, ``3 s^2 = width``); the last one ends in a
    small classification head."""

    def __init__(self, width: int, *, first: bool = False, num_classes: int = 0) -> None:
        super().__init__()
        self.first = first
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes) if num_classes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = x.flatten(1)
        x = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(x) if self.head is not None else x


def make_model(width: int = 768, num_blocks: int = NUM_BLOCKS, num_classes: int = 4) -> nn.Module:
    """The check's model (``module:factory`` for the workers): ``num_blocks`` equal blocks,
    each one DAG node when the job names them leaf modules."""
    return nn.Sequential(
        *(Block(width, first=i == 0, num_classes=num_classes if i == num_blocks - 1 else 0) for i in range(num_blocks))
    )


def fast_topology(num_hosts: int) -> Topology:
    """``num_hosts`` hosts in one cluster joined by fast links."""
    hosts = "".join(f'[[hosts]]\nname = "h{i}"\ncluster = "lab"\n' for i in range(num_hosts))
    links = (
        f'[[links]]\nfrom = "lab"\nto = "lab"\nbandwidth_mbps = {FAST_LINK_MBPS}\nlatency_ms = {FAST_LINK_LATENCY_MS}\n'
    )
    return Topology.from_toml(hosts + (links if num_hosts > 1 else ""), source=f"fast-{num_hosts}")


def job_toml(*, num_stages: int, micro_batches: int, micro_batch_size: int, steps: int, out_dir: Path) -> str:
    """The check's job: :func:`make_model` split evenly over ``num_stages`` workers."""
    leaves = ", ".join(f'"{i}"' for i in range(NUM_BLOCKS))
    return f"""name = "dilation-check-{num_stages}"
[model]
name = "testbeds.bench.dilation_check:make_model"
leaf_modules = [{leaves}]
[data]
name = "shapes"
batch_size = {micro_batches * micro_batch_size}
image_size = 16
num_classes = 4
num_samples = {micro_batches * micro_batch_size * 4}
[train]
steps = {steps}
micro_batches = {micro_batches}
optimizer = "sgd"
lr = 0.01
[cluster]
min_workers = {num_stages}
[plan]
strategy = "uniform"
[output]
dir = "{out_dir}"
"""


def run_one(
    num_hosts: int, dilation: float, args: argparse.Namespace, work: Path, log: logging.Logger
) -> dict[str, Any]:
    """One job on a fresh testbed of ``num_hosts`` hosts: its step time (emulated world's time)."""
    name = f"k{num_hosts}-d{dilation:g}"
    run_dir = work / name
    run_dir.mkdir(parents=True)
    job = run_dir / "job.toml"
    job.write_text(
        job_toml(
            num_stages=num_hosts,
            micro_batches=args.micro_batches,
            micro_batch_size=args.micro_batch_size,
            steps=args.steps,
            out_dir=run_dir / "out",
        )
    )
    t0 = time.monotonic()
    with open_testbed(fast_topology(num_hosts), backend=args.backend, dilation=dilation) as tb:
        run = TestbedRun(tb, run_dir / "logs", echo=log.debug, allow_code=True, dilation=dilation)
        run.start()
        job_id = run.submit(job)
        status = run.follow(job_id, timeout_s=args.timeout)
    if status["state"] != "succeeded":
        raise FusionError(f"{name}: job {job_id} {status['state']}: {status.get('reason')} (logs in {run_dir})")
    records = [json.loads(line) for line in (Path(status["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step_s"] for r in records if r["step"] >= args.warmup] or [r["step_s"] for r in records]
    stages = (status.get("plan") or {}).get("stages") or []
    result = {
        "num_hosts": num_hosts,
        "dilation": dilation,
        "step_s": undilate_s(trimmed_mean(timed), dilation),
        "step_s_each": [undilate_s(s, dilation) for s in timed],
        "stages": [st["worker"] for st in stages],
        "wall_s": time.monotonic() - t0,
    }
    log.info(
        "%s: %.4f s a step (%s), %d stages, %.0f s of wall time",
        name,
        result["step_s"],
        dilation_label(dilation) or "undilated",
        len(stages),
        result["wall_s"],
    )
    return result


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Run every job of the check and judge it (module docstring)."""
    dilation = check_dilation(args.dilate)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    bad = [k for k in ks if k < 2 or NUM_BLOCKS % k]
    if bad:
        raise FusionError(f"--ks: every k must be >= 2 and divide {NUM_BLOCKS} (the model's blocks), got {bad}")
    log = logging.getLogger(__name__)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fusion-dilation-check-"))
    log.info("work in %s", work)
    one = run_one(1, dilation, args, work, log)
    one_plain = run_one(1, 1.0, args, work, log)
    m = args.micro_batches
    pipelines = {}
    for k in ks:
        r = run_one(k, dilation, args, work, log)
        ideal = m * k / (m + k - 1)
        speedup = one["step_s"] / r["step_s"]
        pipelines[str(k)] = {
            **r,
            "speedup": speedup,
            "ideal_speedup": ideal,
            "ratio": speedup / ideal,
            "ok": speedup / ideal >= MIN_SPEEDUP_RATIO and len(r["stages"]) == k,
        }
    gap = abs(one["step_s"] - one_plain["step_s"]) / one_plain["step_s"]
    return {
        "dilation": dilation,
        "label": dilation_label(dilation),
        "micro_batches": m,
        "micro_batch_size": args.micro_batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "backend": args.backend,
        "links": {"bandwidth_mbps": FAST_LINK_MBPS, "latency_ms": FAST_LINK_LATENCY_MS, "dilated": True},
        "one_host": one,
        "one_host_undilated": one_plain,
        "one_host_gap": gap,
        "one_host_ok": gap <= MAX_ONE_HOST_GAP,
        "pipelines": pipelines,
        "targets": {"min_speedup_ratio": MIN_SPEEDUP_RATIO, "max_one_host_gap": MAX_ONE_HOST_GAP},
        "ok": gap <= MAX_ONE_HOST_GAP and all(p["ok"] for p in pipelines.values()),
        "command": "python -m testbeds.bench.dilation_check " + " ".join(sys.argv[1:]),
    }


def table(doc: dict[str, Any]) -> str:
    """The check's result as a Markdown table a reader can judge."""
    label = doc["label"] or "undilated"
    lines = [
        f"Step times {label} (measured {doc['dilation']:g}x slower, divided), M = {doc['micro_batches']} micro-batches",
        "",
        "| hosts (stages) | step s | speed-up | ideal | ratio | target >= 0.8 |",
        "|---|---|---|---|---|---|",
        f"| 1 | {doc['one_host']['step_s']:.4f} | 1.00 | 1.00 | - | - |",
    ]
    for k, p in doc["pipelines"].items():
        lines.append(
            f"| {k} | {p['step_s']:.4f} | {p['speedup']:.2f} | {p['ideal_speedup']:.2f} | {p['ratio']:.2f} | "
            f"{'met' if p['ok'] else 'MISSED'} |"
        )
    lines += [
        "",
        f"One host: {doc['one_host']['step_s']:.4f} s a step {label}, {doc['one_host_undilated']['step_s']:.4f} s "
        f"undilated: gap {100 * doc['one_host_gap']:.1f} % (target <= 10 %: "
        f"{'met' if doc['one_host_ok'] else 'MISSED'})",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.bench.dilation_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dilate", type=float, default=8.0, metavar="D", help="time dilation (default: %(default)s)")
    p.add_argument("--ks", default="2,4,6", help="pipeline depths, each dividing 12 (default: %(default)s)")
    p.add_argument("--micro-batches", type=int, default=24, help="micro-batches a step (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="samples a micro-batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="steps a run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (default: %(default)s)")
    p.add_argument("--backend", default="proxy", help="testbed backend (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="where the runs' logs go (default: a temp dir, kept)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        doc = check(args)
    except FusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
