"""Pipeline schedules: per-stage action lists, their invariants, and deadlock freedom."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from executor.schedule import SCHEDULES, Action, max_stashed, stage_actions
from fusion.errors import ConfigError


def _names(actions: Sequence[Action]) -> list[str]:
    return [str(a) for a in actions]


def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    for depth in (0, 1, 4):
        actions = stage_actions("gpipe", num_micro_batches=3, depth=depth)
        assert _names(actions) == ["F0", "F1", "F2", "B0", "B1", "B2"]
        assert max_stashed(actions) == 3


def test_1f1b_at_depth_zero_alternates() -> None:
    actions = stage_actions("1f1b", num_micro_batches=3, depth=0)
    assert _names(actions) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert max_stashed(actions) == 1


def test_1f1b_warms_up_depth_forwards() -> None:
    actions = stage_actions("1f1b", num_micro_batches=5, depth=2)
    assert _names(actions) == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]


def test_1f1b_deeper_than_micro_batches_is_gpipe() -> None:
    assert stage_actions("1f1b", num_micro_batches=2, depth=5) == stage_actions("gpipe", num_micro_batches=2, depth=5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth", range(6))
@pytest.mark.parametrize("num_micro_batches", [1, 2, 3, 5, 8])
def test_action_list_invariants(schedule: str, depth: int, num_micro_batches: int) -> None:
    actions = stage_actions(schedule, num_micro_batches=num_micro_batches, depth=depth)
    forwards = [a.micro_batch_idx for a in actions if a.kind == "F"]
    backwards = [a.micro_batch_idx for a in actions if a.kind == "B"]
    assert forwards == list(range(num_micro_batches)), "each micro-batch forwarded once, in order"
    assert backwards == list(range(num_micro_batches)), "each micro-batch backwarded once, in order"
    assert len(actions) == 2 * num_micro_batches
    position = {(a.kind, a.micro_batch_idx): i for i, a in enumerate(actions)}
    for m in range(num_micro_batches):
        assert position[("F", m)] < position[("B", m)]
    assert all(isinstance(a, Action) and a.kind in ("F", "B") for a in actions)


@pytest.mark.parametrize("depth", range(6))
@pytest.mark.parametrize("num_micro_batches", range(1, 9))
def test_1f1b_stash_is_bounded_by_depth(depth: int, num_micro_batches: int) -> None:
    actions = stage_actions("1f1b", num_micro_batches=num_micro_batches, depth=depth)
    assert max_stashed(actions) <= min(depth, num_micro_batches) + 1
    assert max_stashed(actions) == min(depth + 1, num_micro_batches)


def test_max_stashed_counts_live_forwards() -> None:
    assert max_stashed([]) == 0
    assert max_stashed([Action("F", 0), Action("F", 1), Action("B", 0), Action("F", 2)]) == 2


@pytest.mark.parametrize("num_micro_batches", [0, -1])
def test_no_micro_batches_is_a_config_error(num_micro_batches: int) -> None:
    for schedule in SCHEDULES:
        with pytest.raises(ConfigError, match="num_micro_batches"):
            stage_actions(schedule, num_micro_batches=num_micro_batches, depth=0)


@pytest.mark.parametrize("schedule", ["interleaved", "GPIPE", ""])
def test_unknown_schedule_is_a_config_error(schedule: str) -> None:
    with pytest.raises(ConfigError, match="unknown schedule"):
        stage_actions(schedule, num_micro_batches=2, depth=0)


# ---------------------------------------------------------------- deadlock freedom
def _depths(consumers: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Longest path, in stages, from each stage to a sink."""
    depth: dict[int, int] = {}

    def visit(s: int) -> int:
        if s not in depth:
            depth[s] = max((visit(d) + 1 for d in consumers[s]), default=0)
        return depth[s]

    for s in consumers:
        visit(s)
    return depth


def run_blocking(consumers: Mapping[int, Sequence[int]], todo: Mapping[int, Sequence[Action]]) -> list[tuple[int, str]]:
    """Run every stage's action list with blocking receives; return the global order of work.

    ``F_m`` on a stage waits for ``F_m`` on each of its producers; ``B_m`` waits for ``F_m``
    on the stage itself and ``B_m`` on each of its consumers (the loss stage starts the
    backward itself). Each round, every stage whose next action is ready runs it; if no
    stage can move before all are done, the schedule deadlocks.
    """
    producers = {s: [p for p, dsts in consumers.items() if s in dsts] for s in consumers}
    next_idx = dict.fromkeys(consumers, 0)
    done: set[tuple[int, str, int]] = set()
    order: list[tuple[int, str]] = []

    def ready(s: int, a: Action) -> bool:
        m = a.micro_batch_idx
        if a.kind == "F":
            return all((p, "F", m) in done for p in producers[s])
        return (s, "F", m) in done and all((c, "B", m) in done for c in consumers[s])

    total = sum(len(actions) for actions in todo.values())
    while len(done) < total:
        runnable = [s for s in consumers if next_idx[s] < len(todo[s]) and ready(s, todo[s][next_idx[s]])]
        if not runnable:
            blocked = {s: str(todo[s][next_idx[s]]) for s in consumers if next_idx[s] < len(todo[s])}
            raise AssertionError(f"deadlock: stages blocked at {blocked}")
        for s in runnable:
            a = todo[s][next_idx[s]]
            done.add((s, a.kind, a.micro_batch_idx))
            order.append((s, str(a)))
            next_idx[s] += 1
    return order


def simulate(schedule: str, consumers: Mapping[int, Sequence[int]], num_micro_batches: int) -> list[tuple[int, str]]:
    """Run ``schedule`` on the stage graph ``consumers`` (stage -> stages it sends to)."""
    depth = _depths(consumers)
    todo = {s: stage_actions(schedule, num_micro_batches=num_micro_batches, depth=depth[s]) for s in consumers}
    return run_blocking(consumers, todo)


def chain(num_stages: int) -> dict[int, list[int]]:
    return {s: [s + 1] if s + 1 < num_stages else [] for s in range(num_stages)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("num_micro_batches", range(1, 7))
def test_chain_completes_without_deadlock(schedule: str, num_stages: int, num_micro_batches: int) -> None:
    order = simulate(schedule, chain(num_stages), num_micro_batches)
    assert len(order) == 2 * num_stages * num_micro_batches


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_micro_batches", range(1, 7))
@pytest.mark.parametrize(
    "consumers",
    [
        {0: [1, 2], 1: [2], 2: []},  # skip connection: 0 feeds 1 and 2
        {0: [1, 2], 1: [3], 2: [3], 3: []},  # diamond
        {0: [1, 3], 1: [2], 2: [3], 3: []},  # long and short branch
        {0: [2], 1: [2], 2: []},  # two sources
    ],
    ids=["skip", "diamond", "uneven", "two-sources"],
)
def test_stage_dags_complete_without_deadlock(
    schedule: str, num_micro_batches: int, consumers: dict[int, list[int]]
) -> None:
    order = simulate(schedule, consumers, num_micro_batches)
    assert len(order) == 2 * len(consumers) * num_micro_batches


def test_simulation_detects_a_deadlock() -> None:
    """The simulator can fail: a producer that waits for a backward before its forward hangs."""
    todo = {0: [Action("B", 0), Action("F", 0)], 1: [Action("F", 0), Action("B", 0)]}
    with pytest.raises(AssertionError, match="deadlock"):
        run_blocking(chain(2), todo)


def test_simulated_order_respects_dependencies() -> None:
    order = simulate("1f1b", chain(3), 4)
    position = {item: i for i, item in enumerate(order)}
    for m in range(4):
        assert position[(0, f"F{m}")] < position[(1, f"F{m}")] < position[(2, f"F{m}")]
        assert position[(2, f"B{m}")] < position[(1, f"B{m}")] < position[(0, f"B{m}")]
