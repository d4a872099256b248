"""Convergence cost of compression: the same 3-stage job with and without top-k on a slow cut.

    python -m testbeds.bench.convergence [--steps 300] [--out testbeds/results/convergence]

For GPT-2 tiny on the Python-sources text and a small ResNet on the generated image set,
the model is split into three stages (an even split over three local workers) and the
cut between stages 1 and 2 is treated as slow: its link is *emulated* at 8 Mbps and 40 ms
for the AdaTopK controller (the real shaping is the testbeds' job; here only the loss
matters). Runs, all from the same seed and data order:

- ``none``: dense, the baseline;
- ``topk-0.1`` and ``topk-0.01``: fixed keep ratios on activations and gradients;
- ``adatopk-100mbps`` / ``adatopk-8mbps``: the ratio follows the emulated link so its
  transfer time per micro-batch matches the slowest stage's compute, clamped at
  ``min_keep_ratio``.

Writes ``convergence.md`` (final loss — mean of the last 20 steps — and its gap to
``none``, plus the ratios AdaTopK chose) and ``convergence.png`` (loss against step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from compress import AdaTopK
from executor.compression import CutSetting, RatioController
from fusion.config import JobSpec
from fusion.launch.distributed import train_distributed
from fusion.launch.executors import LocalCluster
from fusion.wire import tensor_pb2 as pb

SLOW_CUT = (1, 2)
#: Emulated slow links for AdaTopK: (latency s, bandwidth bytes/s).
LINKS = {"100mbps": (0.020, 100e6 / 8), "8mbps": (0.040, 8e6 / 8)}

JOBS = {
    "gpt2-tiny": {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 16, "seq_len": 64, "shuffle": True},
        "train": {"micro_batches": 2, "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.0},
    },
    "resnet-tiny": {
        "model": {"name": "resnet", "preset": "tiny", "num_classes": 16},
        # Noisy enough that the loss does not collapse to zero in 300 steps.
        "data": {
            "batch_size": 32,
            "image_size": 16,
            "num_classes": 16,
            "num_samples": 4096,
            "noise": 5.0,
            "shuffle": True,
        },
        "train": {"micro_batches": 1, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
    },
}

RUNS = {
    "none": None,
    "topk-0.1": 0.1,
    "topk-0.01": 0.01,
    "adatopk-100mbps": "100mbps",
    "adatopk-8mbps": "8mbps",
}


def run_one(addresses: list[str], job: JobSpec, mode: Any) -> dict[str, Any]:
    settings = None
    controller = None
    if mode is not None:
        adaptive = mode in LINKS
        start = 1.0 if adaptive else float(mode)  # AdaTopK starts dense, then follows the link
        settings = {SLOW_CUT: CutSetting(codec=pb.CODEC_TOPK, keep_ratio=start, activations=True, gradients=True)}
        if adaptive:
            link = LINKS[mode]
            controller = RatioController(
                AdaTopK(min_keep_ratio=job.compression.min_keep_ratio),
                link_of=lambda a, b: link if (a, b) == SLOW_CUT else None,
            )
    ratios: list[float] = []
    sizes: list[tuple[int, int]] = []

    def on_step(stats: Any) -> None:
        if SLOW_CUT in stats.keep_ratios:
            ratios.append(stats.keep_ratios[SLOW_CUT])
            sizes.append((stats.dense_bytes.get(SLOW_CUT, 0), stats.sent_bytes.get(SLOW_CUT, 0)))

    result = train_distributed(job, addresses, cut_settings=settings, ratio_controller=controller, on_step=on_step)
    return {"losses": result.losses, "ratios": ratios, "bytes": sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.bench.convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="testbeds/results/convergence")
    parser.add_argument("--jobs", default=",".join(JOBS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with LocalCluster(3) as cluster:
        for name in args.jobs.split(","):
            job = JobSpec.from_dict({**JOBS[name], "train": {**JOBS[name]["train"], "steps": args.steps}})
            for run, mode in RUNS.items():
                print(f"{name} {run} ...", file=sys.stderr, flush=True)
                results.setdefault(name, {})[run] = run_one(cluster.addresses, job, mode)
    (out / "convergence.json").write_text(json.dumps(results))
    lines = ["# Convergence with compression on one slow cut (3 stages)", ""]
    lines.append(
        f"{args.steps} steps; final loss = mean of the last 20 steps; "
        "AdaTopK's slow cut emulated at 100 Mbps / 20 ms and 8 Mbps / 40 ms."
    )
    lines.append("")
    lines.append("| job | run | final loss | vs none | mean keep ratio | bytes on the cut (after / before) |")
    lines.append("|---|---|---|---|---|---|")
    for name, runs in results.items():
        base = statistics.mean(runs["none"]["losses"][-20:])
        for run, r in runs.items():
            final = statistics.mean(r["losses"][-20:])
            ratio = f"{statistics.mean(r['ratios']):.4f}" if r["ratios"] else "1 (dense)"
            dense = sum(d for d, _ in r["bytes"])
            sent = sum(s for _, s in r["bytes"])
            frac = f"{sent / dense:.3f}" if dense else "1.000"
            lines.append(f"| {name} | {run} | {final:.4f} | {100 * (final - base) / base:+.2f}% | {ratio} | {frac} |")
    lines.append("")
    for name, runs in results.items():
        for run, r in runs.items():
            rs = r["ratios"]
            if run.startswith("adatopk") and rs:
                lines.append(
                    f"{run} on {name}: started at {rs[0]:.4f}, settled at {rs[-1]:.4f} "
                    f"(min {min(rs):.4f}, max {max(rs):.4f})."
                )
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(results, out / "convergence.png")
    return 0


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), dpi=100, squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items(), strict=False):
        for run, r in runs.items():
            losses = r["losses"]
            window = 10
            smooth = [statistics.mean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
            ax.plot(smooth, label=run, linewidth=1.3)
        ax.set_title(f"{name} (3 stages, slow cut 1->2)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (moving mean of 10)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
