"""The node profile (``fusion.profiling.profile_graph``) on a small traced model: what it
returns, and that the whole-graph timing, which sets every node's level, repeats until it
has measured enough time to outvote a preemption."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from fusion.profiling import profile_graph, trimmed_mean


@torch.fx.wrap
def counted(x: torch.Tensor) -> torch.Tensor:
    """An identity that fx keeps as one node; counts the graph's runs."""
    CALLS.append(1)
    return x


CALLS: list[int] = []


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(counted(x))))


def traced_with_counter() -> tuple[torch.fx.GraphModule, list[int]]:
    CALLS.clear()
    return torch.fx.symbolic_trace(Mlp()), CALLS


def test_profile_covers_every_compute_node_and_sums_to_the_graph() -> None:
    gm, _ = traced_with_counter()
    profile = profile_graph(gm, (torch.randn(8, 16),), repeats=3, warmup=1, min_time_s=0.0)
    compute = {n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
    assert set(profile) == compute | {"__graph__"}
    graph = profile["__graph__"]
    assert sum(profile[n]["fwd_time_s"] for n in compute) == pytest.approx(graph["fwd_time_s"])
    assert sum(profile[n]["bwd_time_s"] for n in compute) == pytest.approx(graph["bwd_time_s"])
    # Each saved storage is charged once, to the node that saved it first: fc1 keeps its
    # input (8 x 16 float32), relu its output (8 x 32), which fc2 then saves again for free.
    assert profile["fc1"]["saved_bytes"] == 8 * 16 * 4
    assert profile["relu"]["saved_bytes"] == 8 * 32 * 4
    assert profile["fc2"]["saved_bytes"] == 0


def test_whole_graph_timing_repeats_until_min_time() -> None:
    gm, calls = traced_with_counter()
    profile_graph(gm, (torch.randn(8, 16),), repeats=3, warmup=1, min_time_s=0.0)
    # (warm-up + repeats) whole-graph runs, then as many node by node; no more without a minimum.
    assert len(calls) == 2 * (1 + 3)

    gm, calls = traced_with_counter()
    profile = profile_graph(gm, (torch.randn(8, 16),), repeats=3, warmup=1, min_time_s=0.5)
    # A step of this model takes well under a millisecond: 0.5 s takes more repeats (how
    # many depends on how busy the machine is, so only "more" is asserted), and the time
    # reported is one step's, not the 0.5 s of all of them.
    assert len(calls) > 2 * (1 + 3)
    assert profile["__graph__"]["fwd_time_s"] < 0.1


class Skewed(torch.nn.Module):
    """A heavy forward on an input, which needs no gradient, beside a light layer that does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        mixed = torch.matmul(table, table)
        return self.fc(x) + mixed.mean()


def test_backward_is_measured_per_node_not_spread_by_forward() -> None:
    gm = torch.fx.symbolic_trace(Skewed())
    profile = profile_graph(gm, (torch.randn(8, 64), torch.randn(384, 384)), repeats=9, warmup=1, min_time_s=0.0)
    graph_bwd = profile["__graph__"]["bwd_time_s"]
    # The matmul is most of the forward, and has no backward at all: spread by forward
    # shares, it would carry most of the backward too.
    assert profile["matmul"]["fwd_time_s"] > 0.5 * profile["__graph__"]["fwd_time_s"]
    assert profile["matmul"]["bwd_time_s"] == 0.0
    assert profile["mean"]["bwd_time_s"] == 0.0
    assert profile["fc"]["bwd_time_s"] > 0.5 * graph_bwd
    assert sum(v["bwd_time_s"] for k, v in profile.items() if k != "__graph__") == pytest.approx(graph_bwd)


def test_trimmed_mean_drops_each_tail() -> None:
    # Ten samples, 10 % at each end: the 0.001 and the 0.5 (a preemption) go.
    values = [0.001, 0.5] + [0.010] * 4 + [0.020] * 4
    assert trimmed_mean(values) == pytest.approx(0.015)
    assert trimmed_mean([0.3]) == 0.3
