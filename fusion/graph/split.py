"""Cut an OP-DAG into stages and build each stage's runnable sub-graph.

Given any assignment of compute nodes to stage indices whose stage graph is acyclic (a
chain of contiguous ranges, or a general cut where a value skips stages or feeds several),
:func:`split_stages` works out each stage's boundary: which values it receives and from
where, which it sends and to whom. :func:`build_stage_module` then turns a stage into an
``fx.GraphModule`` whose placeholders are the received values and whose outputs are the
sent ones (plus the model output on the loss stage).

Rules that keep every boundary sendable:

- model inputs (placeholders) come from the driver (source stage ``-1``);
- ``get_attr`` nodes (parameters, buffers, constants) are replicated into every stage that
  reads them — a parameter read on two stages is *tied* across them, and the executor sums
  its gradients;
- a value that cannot travel (a tuple of tensors, an arbitrary object) pulls its consumers
  onto its producer's stage; if that makes the stage graph cyclic the split is refused.

This module imports torch only inside :func:`build_stage_module`, so the scheduler can use
the boundary logic without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusion.errors import SplitError
from fusion.graph.ir import OpDag

if TYPE_CHECKING:
    import torch.fx as fx

#: Source stage index of values the driver sends (model inputs and targets).
DRIVER = -1


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage's nodes and boundary, derived from an assignment."""

    stage_idx: int
    """Index of the stage (``0 .. num_stages-1``)."""
    nodes: tuple[str, ...]
    """Compute nodes of the stage, in topological order."""
    attrs: tuple[str, ...]
    """``get_attr`` nodes the stage reads (replicated per stage)."""
    inputs: tuple[tuple[str, int], ...]
    """Received values as ``(value name, source stage)``; source ``-1`` is the driver."""
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    """Sent values as ``(value name, destination stages)``."""
    is_loss_stage: bool
    """Whether this stage holds the model output and computes the loss."""
    depth: int
    """Longest path, in stages, from this stage to a sink (sets 1F1B warm-up)."""
    params: tuple[str, ...] = field(default=())
    """``state_dict`` names of the parameters the stage holds."""
    buffers: tuple[str, ...] = field(default=())
    """``state_dict`` names of the buffers the stage holds."""

    @property
    def producers(self) -> tuple[int, ...]:
        """Stages this stage receives from (not the driver), sorted."""
        return tuple(sorted({src for _, src in self.inputs if src != DRIVER}))

    @property
    def consumers(self) -> tuple[int, ...]:
        """Stages this stage sends to, sorted."""
        return tuple(sorted({d for _, dsts in self.outputs for d in dsts}))


def normalize_assignment(dag: OpDag, assignment: Mapping[str, int]) -> dict[str, int]:
    """Check an assignment covers every compute node, and keep unsendable values local.

    Returns a new assignment where every consumer of a value that cannot cross a stage
    boundary (see :data:`fusion.graph.ir.SENDABLE_KINDS`) sits on its producer's stage.
    """
    compute = [n.name for n in dag.compute_nodes()]
    missing = [n for n in compute if n not in assignment]
    if missing:
        raise SplitError(f"assignment misses {len(missing)} compute node(s), e.g. {missing[:5]}")
    unknown = [n for n in assignment if n not in dag or not dag.node(n).is_compute]
    if unknown:
        raise SplitError(f"assignment names nodes that are not compute nodes of the DAG: {unknown[:5]}")
    bad = [(n, s) for n, s in assignment.items() if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    if bad:
        raise SplitError(f"stage indices must be non-negative ints; got {bad[:5]}")
    out = dict(assignment)
    consumers = dag.consumers()
    for node in dag.nodes:  # topological order: a pulled consumer may pull its own consumers
        if node.is_compute and not node.value.sendable:
            for dst in consumers[node.name]:
                if dag.node(dst).is_compute:
                    out[dst] = out[node.name]
    return out


def split_stages(dag: OpDag, assignment: Mapping[str, int]) -> list[StageSpec]:
    """Derive every stage's boundary from a node → stage assignment.

    Raises:
        SplitError: the assignment is incomplete, names unknown nodes, leaves a stage
            index empty, or makes the stage graph cyclic (the message shows the cycle).
    """
    if any(n.op == "group" for n in dag.nodes):
        raise SplitError(
            "cannot split a coarsened DAG directly: map the assignment with dag.expand_assignment() "
            "and split the original DAG"
        )
    stage_of = normalize_assignment(dag, assignment)
    num_stages = max(stage_of.values(), default=-1) + 1
    used = set(stage_of.values())
    empty = [s for s in range(num_stages) if s not in used]
    if empty:
        raise SplitError(f"stage(s) {empty} have no nodes; stage indices must be 0..{num_stages - 1} without gaps")

    nodes_of: list[list[str]] = [[] for _ in range(num_stages)]
    attrs_of: list[dict[str, None]] = [{} for _ in range(num_stages)]
    inputs_of: list[dict[str, int]] = [{} for _ in range(num_stages)]
    outputs_of: list[dict[str, set[int]]] = [{} for _ in range(num_stages)]
    links: dict[tuple[int, int], list[tuple[str, str]]] = {}

    for node in dag.nodes:
        if not node.is_compute:
            continue
        s = stage_of[node.name]
        nodes_of[s].append(node.name)
        for src_name in node.inputs:
            src = dag.node(src_name)
            if src.op == "get_attr":
                attrs_of[s][src_name] = None
            elif src.op == "placeholder":
                inputs_of[s].setdefault(src_name, DRIVER)
            elif stage_of[src_name] != s:
                src_stage = stage_of[src_name]
                if not src.value.sendable:
                    raise SplitError(
                        f"value {src_name!r} ({src.value.kind}) cannot cross from stage {src_stage} to {s}"
                    )
                inputs_of[s].setdefault(src_name, src_stage)
                outputs_of[src_stage].setdefault(src_name, set()).add(s)
                links.setdefault((src_stage, s), []).append((src_name, node.name))

    out_node = dag.node(dag.output)
    if not out_node.is_compute:
        raise SplitError(f"the model output {dag.output!r} is a {out_node.op}, not computed by any stage")
    loss_stage = stage_of[dag.output]

    order = _topological_stage_order(num_stages, links)
    depth = [0] * num_stages
    for s in reversed(order):
        depth[s] = max((depth[d] + 1 for (a, d) in links if a == s), default=0)

    specs = []
    for s in range(num_stages):
        params: dict[str, None] = {}
        buffers: dict[str, None] = {}
        for name in [*nodes_of[s], *attrs_of[s]]:
            node = dag.node(name)
            params.update(dict.fromkeys(node.params))
            buffers.update(dict.fromkeys(node.buffers))
        specs.append(
            StageSpec(
                stage_idx=s,
                nodes=tuple(nodes_of[s]),
                attrs=tuple(attrs_of[s]),
                inputs=tuple(inputs_of[s].items()),
                outputs=tuple((v, tuple(sorted(d))) for v, d in outputs_of[s].items()),
                is_loss_stage=s == loss_stage,
                depth=depth[s],
                params=tuple(params),
                buffers=tuple(buffers),
            )
        )
    return specs


def _topological_stage_order(num_stages: int, links: Mapping[tuple[int, int], Sequence[tuple[str, str]]]) -> list[int]:
    """Kahn's algorithm over stages; on a cycle, raise with the cycle and the values on it."""
    succ: dict[int, set[int]] = {s: set() for s in range(num_stages)}
    indeg = [0] * num_stages
    for a, b in links:
        if b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    ready = [s for s in range(num_stages) if indeg[s] == 0]
    order: list[int] = []
    while ready:
        s = ready.pop()
        order.append(s)
        for d in sorted(succ[s]):
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    if len(order) == num_stages:
        return order
    cycle = _find_cycle({s for s in range(num_stages) if s not in order}, succ)
    hops = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        src, dst = links[(a, b)][0]
        hops.append(f"stage {a} -> stage {b} (value {src!r} read by {dst!r})")
    raise SplitError("the assignment makes the stage graph cyclic: " + "; ".join(hops) + ". Stages must form a DAG.")


def _find_cycle(nodes: set[int], succ: Mapping[int, set[int]]) -> list[int]:
    """A cycle among ``nodes`` (the stages Kahn's algorithm could not order).

    Those stages are on a cycle or downstream of one; pruning the ones with no successor
    left leaves only stages that each have a successor in the set, so walking always
    closes a cycle.
    """
    nodes = set(nodes)
    while True:
        sinks = {n for n in nodes if not (succ[n] & nodes)}
        if not sinks:
            break
        nodes -= sinks
    start = min(nodes)
    path = [start]
    seen = {start: 0}
    while True:
        nxt = min(d for d in succ[path[-1]] if d in nodes)
        if nxt in seen:
            return path[seen[nxt] :] + [nxt]
        seen[nxt] = len(path)
        path.append(nxt)


def build_stage_module(gm: fx.GraphModule, spec: StageSpec) -> fx.GraphModule:
    """Build a stage's sub-graph as an independent ``GraphModule``.

    Placeholders are the stage's inputs in ``spec.inputs`` order; the module returns a
    tuple of the values in ``spec.outputs`` order, followed (on the loss stage) by the model
    output. Parameters are deep-copied, so two stages on one worker never share a tensor
    (ties inside one stage are kept).
    """
    import copy

    import torch.fx as fx

    by_name = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name, _ in spec.inputs:
        env[name] = graph.placeholder(name)
    for name in spec.attrs:
        env[name] = graph.node_copy(by_name[name], lambda n: env[n.name])
    for name in spec.nodes:
        try:
            env[name] = graph.node_copy(by_name[name], lambda n: env[n.name])
        except KeyError as e:
            raise SplitError(
                f"stage {spec.stage_idx}: node {name!r} reads {e.args[0]!r}, which is not available on the stage"
            ) from e
    results = [env[name] for name, _ in spec.outputs]
    if spec.is_loss_stage:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        results.append(env[out_node.args[0].name])
    graph.output(tuple(results))
    graph.lint()
    stage = fx.GraphModule(gm, graph, f"Stage{spec.stage_idx}")
    return copy.deepcopy(stage)
