"""The one parity helper: a distributed run against single-process PyTorch.

Losses, every parameter's gradient (of the last step, before its update) and every
``state_dict`` entry after the run (parameters and BatchNorm buffers) must match.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fusion.config import JobSpec
from fusion.coordinator.outputs import read_history
from fusion.graph.ir import OpDag
from fusion.launch.distributed import DistributedResult, train_distributed
from fusion.training import train_reference

# Summation order differs between one process and micro-batches over stages; fp32 noise
# stays far below these bounds, a wrong gradient does not.
RTOL = 1e-4
ATOL = 1e-5
#: GPT-2's key bias (the middle third of ``attn.c_attn.bias``) has a gradient of exactly
#: zero: it adds ``q · b_k`` to every score of a query's row, and the softmax ignores a
#: constant shift. What it gets is fp32 rounding noise (~1e-10), which AdamW divides by
#: ``sqrt(v) + eps`` into steps of ~1e-5: after tens of steps two correct runs hold different
#: noise there (seen in CI: 1.08e-5 apart, 7.8e-6 against -3e-6). Those entries must stay
#: noise, far below what a trained bias reaches (~1e-2), but are not compared entry by entry.
KEY_BIAS = re.compile(r"(.*\.)?attn\.c_attn\.bias$")
NOISE_BOUND = 1e-4


def assert_parity(
    job: JobSpec,
    addresses: Sequence[str],
    *,
    steps: int = 1,
    assignment: Mapping[str, int] | None = None,
    accumulate: bool = False,
    stage_workers: Sequence[int] | None = None,
    device: str = "cpu",
    link_bytes_per_s: Mapping[tuple[int, int], float] | None = None,
    feed_bytes_per_s: Mapping[int, float] | None = None,
) -> DistributedResult:
    """Run ``job`` distributed and in one process, both on ``device``; assert they agree;
    return the distributed run."""
    ref = train_reference(job, steps=steps, accumulate=accumulate, device=device)
    got = train_distributed(
        job,
        addresses,
        steps=steps,
        assignment=assignment,
        collect_gradients=True,
        stage_workers=stage_workers,
        device=device,
        link_bytes_per_s=link_bytes_per_s,
        feed_bytes_per_s=feed_bytes_per_s,
    )
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=RTOL, atol=ATOL)
    assert set(got.gradients) == set(ref.gradients), set(got.gradients) ^ set(ref.gradients)
    for name, g in ref.gradients.items():
        torch.testing.assert_close(
            got.gradients[name], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"gradient of {n}: {m}"
        )
    assert_state_close(got.state_dict, ref.state_dict)
    return got


def assert_state_close(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> None:
    """Every ``state_dict`` entry of ``got`` equals ``ref``'s to float tolerance, except the
    entries whose gradient is zero by construction (:data:`KEY_BIAS`), which must stay
    rounding noise in both."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    for name, v in ref.items():
        g = got[name]
        if KEY_BIAS.match(name) and v.ndim == 1 and v.numel() % 3 == 0:
            n = v.numel() // 3
            for t, who in ((g[n : 2 * n], "run"), (v[n : 2 * n], "reference")):
                assert t.abs().max().item() <= NOISE_BOUND, (
                    f"{name}: the key bias of the {who} moved beyond rounding noise: {t}"
                )
            g, v = torch.cat([g[:n], g[2 * n :]]), torch.cat([v[:n], v[2 * n :]])
        torch.testing.assert_close(g, v, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def assert_recorded_losses(metrics: Path, reference: Sequence[float]) -> None:
    """Every step's loss in a job's ``metrics.jsonl`` (a redone step's last) equals the
    reference run's. A step whose loss stage's worker was lost after every stage had
    finished it is resumed after (:meth:`fusion.coordinator.recovery.Recovery.recover`): its
    loss comes from a ``loss_from_snapshot`` event, or it may lack one where a
    ``loss_unrecorded`` event says so."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = dict(read_history(metrics, before=sys.maxsize))
    unrecorded = {r["step"] for r in rows if r.get("event") == "loss_unrecorded"}
    steps = range(len(reference))
    recorded = sorted(last)
    assert unrecorded <= set(steps) and recorded == [i for i in steps if i not in unrecorded], (recorded, unrecorded)
    torch.testing.assert_close(
        torch.tensor([last[i] for i in recorded]),
        torch.tensor([reference[i] for i in recorded]),
        rtol=RTOL,
        atol=ATOL,
    )


def skip_assignment(dag: OpDag, branch: str, num_stages: int) -> dict[str, int]:
    """A non-chain cut: a residual branch on its own stage, its skip jumping over it.

    Nodes before the branch go to stage 0; the branch (module paths matching the regex
    ``branch``, plus whatever between its first and last node feeds it) to stage 1; the
    rest is split evenly over stages ``2 .. num_stages-1``. The block input then feeds two
    stages (1 and 2), and the residual crosses stage 1.
    """
    nodes = dag.compute_nodes()
    pattern = re.compile(branch)
    idx = [i for i, n in enumerate(nodes) if pattern.match(n.module_path)]
    assert idx, f"no node matches {branch!r}"
    first, last = idx[0], idx[-1]
    in_branch = {nodes[i].name for i in idx}
    consumers = dag.consumers()
    # Pull in nodes between first and last that feed the branch (walk backwards).
    for i in range(last, first - 1, -1):
        n = nodes[i]
        if any(c in in_branch for c in consumers[n.name]):
            in_branch.add(n.name)
    tail = [n for n in nodes[first:] if n.name not in in_branch]
    out = {n.name: 0 for n in nodes[:first]}
    out.update({name: 1 for name in in_branch})
    rest = num_stages - 2
    for i, n in enumerate(tail):
        out[n.name] = 2 + i * rest // len(tail)
    return out
