"""The OP-DAG: a model as a graph of operators, as plain data.

An :class:`OpDag` is what the scheduler sees. It is built by :func:`fusion.graph.export.export`
from a captured ``torch.fx`` graph, but it holds only names and numbers (no torch objects),
so it can be printed, pinned in tests, shipped as JSON and planned without torch.

Vocabulary: a *node* is one vertex (an fx node, or a group of them after coarsening); its
*value* is what it outputs. Node kinds (``op``) are the fx ones — ``placeholder`` (a model
input), ``get_attr`` (a parameter, buffer or constant), ``call_module``,
``call_function``, ``call_method``, ``output`` — plus ``group`` for coarsened nodes. Only
*compute* nodes (``call_*`` and ``group``) are placed on stages; placeholders come from the
driver, ``get_attr`` nodes are replicated into every stage that reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fusion.errors import GraphExportError

COMPUTE_OPS = frozenset({"call_module", "call_function", "call_method", "group"})

#: Value kinds that can cross a stage boundary. ``tuple`` and ``other`` cannot: their
#: consumers are kept on the producer's stage (see :mod:`fusion.graph.split`).
SENDABLE_KINDS = frozenset({"tensor", "int", "float", "bool", "ints", "dtype", "device", "none"})


@dataclass(frozen=True, kw_only=True)
class ValueMeta:
    """What a node outputs, as measured by shape propagation on the example inputs."""

    kind: str
    """``tensor``, a scalar kind (``int float bool ints dtype device none``), ``tuple`` or ``other``."""
    dtype: str | None = None
    """Tensor dtype name without the ``torch.`` prefix (``float32``), tensors only."""
    shape: tuple[int, ...] | None = None
    """Tensor shape, tensors only (micro-batch shaped)."""
    size_bytes: int = 0
    """Bytes the value occupies (tensors: numel × element size; scalars: 8; tuples: sum)."""

    @property
    def sendable(self) -> bool:
        """Whether the value may cross a stage boundary."""
        return self.kind in SENDABLE_KINDS

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ValueMeta:
        """Inverse of ``dataclasses.asdict``."""
        shape = d.get("shape")
        return ValueMeta(
            kind=d["kind"],
            dtype=d.get("dtype"),
            shape=tuple(shape) if shape is not None else None,
            size_bytes=int(d.get("size_bytes", 0)),
        )


@dataclass(kw_only=True)
class OpNode:
    """One operator (or a coarsened group of operators) of the OP-DAG."""

    name: str
    """Unique node name (the fx node name)."""
    op: str
    """Node kind: an fx op name or ``group``."""
    target: str
    """What the node runs: a module path, a function or method name, an attribute path."""
    inputs: list[str] = field(default_factory=list)
    """Names of the nodes whose values this node reads, in first-use order, without repeats."""
    params: dict[str, int] = field(default_factory=dict)
    """Parameters the node owns: original ``state_dict`` name → bytes."""
    buffers: dict[str, int] = field(default_factory=dict)
    """Buffers the node owns (BatchNorm statistics ...): ``state_dict`` name → bytes."""
    value: ValueMeta = field(default_factory=lambda: ValueMeta(kind="none"))
    """What the node outputs."""
    flops_fwd: int = 0
    """Forward FLOPs for one micro-batch (``torch.utils.flop_counter``)."""
    flops_bwd: int = 0
    """Backward FLOPs for one micro-batch (2 × forward, the usual estimate for matmul-bound ops)."""
    module_path: str = ""
    """Dotted path of the innermost module the node belongs to (``""`` for the top level)."""
    fwd_time_s: float | None = None
    """Measured forward time per micro-batch, once profiled."""
    bwd_time_s: float | None = None
    """Measured backward time per micro-batch, once profiled."""
    peak_memory_bytes: int | None = None
    """Measured peak memory of running the node, once profiled."""
    saved_bytes: int | None = None
    """Activation bytes autograd keeps from this node until backward (one micro-batch), once profiled."""
    members: list[str] = field(default_factory=list)
    """For ``group`` nodes: the names of the original nodes, in topological order."""

    @property
    def out_bytes(self) -> int:
        """Bytes of the node's output value."""
        return self.value.size_bytes

    @property
    def is_compute(self) -> bool:
        """Whether the node is placed on a stage (as opposed to inputs, attributes, output)."""
        return self.op in COMPUTE_OPS

    @property
    def param_bytes(self) -> int:
        """Total bytes of the parameters the node owns."""
        return sum(self.params.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the ``nodes`` entries of :meth:`OpDag.to_json`)."""
        d = asdict(self)
        d["out_bytes"] = self.out_bytes
        d["value"] = asdict(self.value)
        if self.value.shape is not None:
            d["value"]["shape"] = list(self.value.shape)
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OpNode:
        """Inverse of :meth:`to_dict`."""
        fields = {k: v for k, v in d.items() if k not in ("out_bytes", "value")}
        return OpNode(value=ValueMeta.from_dict(d["value"]), **fields)


@dataclass(frozen=True, kw_only=True)
class OpEdge:
    """A value flowing from ``src`` to ``dst``; ``bytes`` is what would cross if they were cut apart."""

    src: str
    dst: str
    bytes: int
    grad_bytes: int = 0
    """Bytes of the gradient that flows back along the edge (0 for integer values and sizes)."""


@dataclass(kw_only=True)
class OpDag:
    """A model's operator DAG with costs. Nodes are kept in topological order."""

    nodes: list[OpNode]
    """All nodes in topological order (placeholders first, the ``output`` node last)."""
    edges: list[OpEdge]
    """One edge per (producer, consumer) pair."""
    output: str
    """Name of the node whose value is the model output (the loss is computed from it)."""
    capture: str = "fx"
    """How the graph was captured: ``fx`` (torch.fx.symbolic_trace) or ``export`` (torch.export)."""
    fingerprint: str = ""
    """Hash of the captured graph's structure; workers re-capture and must get the same one."""
    tied_params: dict[str, str] = field(default_factory=dict)
    """Parameter aliases: ``state_dict`` name → canonical name, for parameters with several names."""
    reference_flops: float | None = None
    """Matmul FLOP/s of the device that measured the nodes' times (to scale them to other devices)."""
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}
        if len(self._index) != len(self.nodes):
            raise GraphExportError("OpDag has duplicate node names")
        for e in self.edges:
            if e.src not in self._index or e.dst not in self._index:
                raise GraphExportError(f"OpDag edge {e.src}->{e.dst} names an unknown node")
            if self._index[e.src] >= self._index[e.dst]:
                raise GraphExportError(f"OpDag nodes are not in topological order at edge {e.src}->{e.dst}")
        if self.output not in self._index:
            raise GraphExportError(f"OpDag output node {self.output!r} is unknown")

    # ----------------------------------------------------------------- queries
    def node(self, name: str) -> OpNode:
        """The node called ``name``; ``KeyError`` with the name if there is none."""
        try:
            return self.nodes[self._index[name]]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the OpDag") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.nodes)

    def position(self, name: str) -> int:
        """Index of the node in topological order."""
        return self._index[name]

    def compute_nodes(self) -> list[OpNode]:
        """Nodes that are placed on stages, in topological order."""
        return [n for n in self.nodes if n.is_compute]

    def cut_points(self) -> list[bool]:
        """Where a stage may begin: entry ``k`` says whether a boundary just before compute
        node ``k`` (in :meth:`compute_nodes` order; entry ``len`` is the end) keeps every
        value that cannot be sent on one stage.

        A value that cannot cross a boundary (a ``tuple``, say, read by ``getitem`` nodes)
        made by node ``i`` and last read by node ``j`` forbids every boundary in
        ``(i, j]``: :func:`fusion.graph.split.normalize_assignment` would pull its readers
        onto the producer's stage, so a split there is not the split the planner priced.
        A coarsened DAG's groups never straddle such a value (:meth:`coarsen`), so every
        boundary between groups is allowed.
        """
        compute = self.compute_nodes()
        pos = {n.name: i for i, n in enumerate(compute)}
        allowed = [True] * (len(compute) + 1)
        consumers = self.consumers()
        for i, n in enumerate(compute):
            if n.op == "group" or n.value.sendable:
                continue
            last = max((pos[c] for c in consumers[n.name] if c in pos), default=i)
            for k in range(i + 1, last + 1):
                allowed[k] = False
        return allowed

    def input_names(self) -> list[str]:
        """Names of the model inputs (placeholders), in call order."""
        return [n.name for n in self.nodes if n.op == "placeholder"]

    def consumers(self) -> dict[str, list[str]]:
        """Map node name → names of the nodes that read its value."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for e in self.edges:
            out[e.src].append(e.dst)
        return out

    def iter_params(self) -> Iterator[tuple[str, int]]:
        """Every (parameter name, bytes) owned by some node; tied names appear once."""
        seen: set[str] = set()
        for n in self.nodes:
            for name, size in n.params.items():
                canonical = self.tied_params.get(name, name)
                if canonical not in seen:
                    seen.add(canonical)
                    yield canonical, size

    @property
    def total_param_bytes(self) -> int:
        """Bytes of all parameters (tied ones counted once)."""
        return sum(size for _, size in self.iter_params())

    @property
    def total_flops_fwd(self) -> int:
        """Forward FLOPs of one micro-batch through the whole model."""
        return sum(n.flops_fwd for n in self.nodes)

    # ----------------------------------------------------------------- JSON
    def to_json(self, *, indent: int | None = None) -> str:
        """Serialise to JSON (see Contracts in DESIGN.md)."""
        doc = {
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [{"src": e.src, "dst": e.dst, "bytes": e.bytes} for e in self.edges],
            # Parallel to "edges" (kept out of the edge objects, whose keys are a contract).
            "edge_grad_bytes": [e.grad_bytes for e in self.edges],
            "output": self.output,
            "capture": self.capture,
            "fingerprint": self.fingerprint,
            "tied_params": dict(self.tied_params),
            "reference_flops": self.reference_flops,
        }
        return json.dumps(doc, indent=indent)

    @staticmethod
    def from_json(text: str) -> OpDag:
        """Read back what :meth:`to_json` wrote."""
        try:
            doc = json.loads(text)
            return OpDag(
                nodes=[OpNode.from_dict(n) for n in doc["nodes"]],
                edges=[
                    OpEdge(**e, grad_bytes=_item(doc.get("edge_grad_bytes"), i)) for i, e in enumerate(doc["edges"])
                ],
                output=doc["output"],
                capture=doc.get("capture", "fx"),
                fingerprint=doc.get("fingerprint", ""),
                tied_params=dict(doc.get("tied_params", {})),
                reference_flops=doc.get("reference_flops"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GraphExportError(f"not a valid OpDag JSON document: {e}") from e

    # ----------------------------------------------------------------- coarsening
    def coarsen(self, max_nodes: int) -> OpDag:
        """Group compute nodes along the module hierarchy into at most ``max_nodes`` units.

        Groups are maximal runs of consecutive compute nodes (in topological order) that
        share a module-path prefix of some depth, joined where a boundary between them would
        split a value that cannot be sent (:meth:`cut_points`). Runs of one topological
        order can never form a cycle, so the coarse graph is a DAG. The deepest depth that
        fits is used; if even the top level yields too many runs, neighbouring runs are
        merged. Each group lists its original nodes in ``members``; :meth:`expand_assignment`
        maps a placement of groups back to nodes. ``get_attr`` nodes are folded into the
        groups that read them.
        """
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        compute = self.compute_nodes()
        if len(compute) <= max_nodes:
            return self
        max_depth = max((n.module_path.count(".") + 1 if n.module_path else 0) for n in compute)
        allowed = self.cut_points()
        runs: list[list[OpNode]] = []
        for depth in range(max_depth, -1, -1):
            runs = _joined_where_uncuttable(_runs_by_prefix(compute, depth), allowed)
            if len(runs) <= max_nodes:
                break
        while len(runs) > max_nodes:
            runs = _merge_smallest_neighbours(runs)
        return self._grouped(runs)

    def _grouped(self, runs: list[list[OpNode]]) -> OpDag:
        group_of: dict[str, str] = {}
        groups: list[OpNode] = []
        for i, run in enumerate(runs):
            prefix = _common_prefix([n.module_path for n in run])
            name = f"group_{i}" + (f"_{prefix.replace('.', '_')}" if prefix else "")
            for n in run:
                group_of[n.name] = name
            groups.append(
                OpNode(
                    name=name,
                    op="group",
                    target=prefix,
                    module_path=prefix,
                    flops_fwd=sum(n.flops_fwd for n in run),
                    flops_bwd=sum(n.flops_bwd for n in run),
                    members=[n.name for n in run],
                    params={k: v for n in run for k, v in n.params.items()},
                    buffers={k: v for n in run for k, v in n.buffers.items()},
                    fwd_time_s=_sum_or_none(n.fwd_time_s for n in run),
                    bwd_time_s=_sum_or_none(n.bwd_time_s for n in run),
                    peak_memory_bytes=_max_or_none(n.peak_memory_bytes for n in run),
                    # Unprofiled members count their output, as the estimator does for nodes.
                    saved_bytes=sum(n.saved_bytes if n.saved_bytes is not None else n.out_bytes for n in run),
                )
            )
        keep = [n for n in self.nodes if n.op in ("placeholder", "output")]
        for n in self.nodes:
            group_of.setdefault(n.name, n.name)
        # get_attr nodes fold into every group that reads them.
        consumers = self.consumers()
        by_name = {g.name: g for g in groups}
        for n in self.nodes:
            if n.op == "get_attr":
                for dst in consumers[n.name]:
                    g = by_name.get(group_of[dst])
                    if g is not None:
                        g.params.update(n.params)
                        g.buffers.update(n.buffers)
        edge_bytes: dict[tuple[str, str], int] = {}
        edge_grad_bytes: dict[tuple[str, str], int] = {}
        seen_values: set[tuple[str, str]] = set()
        for e in self.edges:
            src, dst = group_of[e.src], group_of[e.dst]
            if src == dst or self.node(e.src).op == "get_attr":
                continue
            if (e.src, dst) in seen_values:  # one value crosses once per destination group
                continue
            seen_values.add((e.src, dst))
            edge_bytes[(src, dst)] = edge_bytes.get((src, dst), 0) + e.bytes
            edge_grad_bytes[(src, dst)] = edge_grad_bytes.get((src, dst), 0) + e.grad_bytes
        # A group's value is what it sends out: the sum of distinct values leaving it.
        out_bytes: dict[str, int] = {}
        for (src, _), size in edge_bytes.items():
            out_bytes[src] = max(out_bytes.get(src, 0), size)
        for g in groups:
            g.value = ValueMeta(kind="group", size_bytes=out_bytes.get(g.name, 0))
        inputs_of: dict[str, list[str]] = {}
        for src, dst in edge_bytes:
            inputs_of.setdefault(dst, []).append(src)
        for g in groups:
            g.inputs = inputs_of.get(g.name, [])
        placeholders = [n for n in keep if n.op == "placeholder"]
        outputs = [
            replace(n, inputs=list(dict.fromkeys(group_of[i] for i in n.inputs))) for n in keep if n.op == "output"
        ]
        output_node = self.node(self.output)
        return OpDag(
            nodes=[*placeholders, *groups, *outputs],
            edges=[
                OpEdge(src=s, dst=d, bytes=b, grad_bytes=edge_grad_bytes[(s, d)]) for (s, d), b in edge_bytes.items()
            ],
            output=group_of[output_node.name],
            capture=self.capture,
            fingerprint=self.fingerprint,
            tied_params=dict(self.tied_params),
            reference_flops=self.reference_flops,
        )

    def expand_assignment(self, assignment: Mapping[str, int]) -> dict[str, int]:
        """Map a stage assignment of (possibly grouped) compute nodes to the original nodes."""
        out: dict[str, int] = {}
        for name, stage_idx in assignment.items():
            node = self.node(name)
            for member in node.members or [name]:
                out[member] = stage_idx
        return out

    def with_profile(self, profile: Mapping[str, Mapping[str, float]], *, reference_flops: float) -> OpDag:
        """A copy with measured costs for the named nodes.

        Args:
            profile: node name → ``{"fwd_time_s", "bwd_time_s", "saved_bytes", "peak_memory_bytes"}``
                (missing keys keep the node's current value).
            reference_flops: matmul FLOP/s of the device that measured the times.
        """
        nodes = []
        for n in self.nodes:
            p = profile.get(n.name)
            if p is None:
                nodes.append(replace(n))
                continue
            nodes.append(
                replace(
                    n,
                    fwd_time_s=float(p.get("fwd_time_s", n.fwd_time_s or 0.0)),
                    bwd_time_s=float(p.get("bwd_time_s", n.bwd_time_s or 0.0)),
                    saved_bytes=int(p.get("saved_bytes", n.saved_bytes or 0)),
                    peak_memory_bytes=int(p["peak_memory_bytes"]) if "peak_memory_bytes" in p else n.peak_memory_bytes,
                )
            )
        return replace(self, nodes=nodes, reference_flops=reference_flops)


def _item(values: list[int] | None, i: int) -> int:
    """``values[i]``, or 0 when the list is absent or shorter (documents from older versions)."""
    return int(values[i]) if values is not None and i < len(values) else 0


def _runs_by_prefix(nodes: list[OpNode], depth: int) -> list[list[OpNode]]:
    runs: list[list[OpNode]] = []
    last_key: str | None = None
    for n in nodes:
        key = ".".join(n.module_path.split(".")[:depth]) if n.module_path else ""
        if runs and key == last_key:
            runs[-1].append(n)
        else:
            runs.append([n])
        last_key = key
    return runs


def _joined_where_uncuttable(runs: list[list[OpNode]], allowed: list[bool]) -> list[list[OpNode]]:
    """``runs`` with each run that begins where no stage may (``allowed`` over the
    concatenated nodes, :meth:`OpDag.cut_points`) joined to the run before it."""
    out: list[list[OpNode]] = []
    start = 0
    for run in runs:
        if out and not allowed[start]:
            out[-1] = out[-1] + run
        else:
            out.append(run)
        start += len(run)
    return out


def _merge_smallest_neighbours(runs: list[list[OpNode]]) -> list[list[OpNode]]:
    """Merge the adjacent pair with the fewest FLOPs (keeps runs contiguous)."""
    costs = [sum(n.flops_fwd for n in r) + len(r) for r in runs]
    i = min(range(len(runs) - 1), key=lambda j: costs[j] + costs[j + 1])
    return [*runs[:i], runs[i] + runs[i + 1], *runs[i + 2 :]]


def _common_prefix(paths: Iterable[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    prefix: list[str] = []
    for items in zip(*parts, strict=False):
        if all(x == items[0] for x in items):
            prefix.append(items[0])
        else:
            break
    return ".".join(prefix)


def _sum_or_none(values: Iterable[float | None]) -> Any:
    vals = list(values)
    return None if any(v is None for v in vals) else sum(v for v in vals if v is not None)


def _max_or_none(values: Iterable[int | None]) -> int | None:
    vals = list(values)
    return None if any(v is None for v in vals) else max((v for v in vals if v is not None), default=0)
