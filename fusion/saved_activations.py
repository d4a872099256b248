"""What autograd keeps for backward, per graph node: one rule for the live and the offline estimate.

A stage's peak memory is its parameters, their gradients and optimizer state, and for each
micro-batch in flight the activations autograd saved for backward
(:mod:`scheduler.estimator`). Those saved bytes are counted one way everywhere:
:class:`SavedBytes`, a ``saved_tensors_hooks`` pack hook that charges each saved storage
once, whole (a view keeps its base alive), to the graph node whose forward saved it, and
skips parameters. The live coordinator gets them from a worker that profiles the model
(:func:`fusion.profiling.profile_graph`, on zeros shaped like the inputs); ``fusion plan``
has no worker and no weights, so :func:`static_saved_bytes` runs the same graph with fake
CPU tensors (shapes, dtypes and strides, no data) under the same hook. Kernels are chosen
by device, and a kernel decides what it saves (the CPU's flash attention keeps less than
the math path the meta device takes), so the fake tensors claim to be on the CPU: the
offline estimate equals what a CPU worker's profile measures.

Neither sees data: a model whose activations depend on the values (rows routed by a
mask, as a mixture of experts routes tokens) is estimated for zero inputs, and a step
that outgrows its worker's cap is caught by the executor's measured peak instead.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusion.graph.ir import OpDag

logger = logging.getLogger(__name__)


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """``(identity, bytes)`` of the storage behind ``t`` (fake and meta tensors included),
    or ``None`` for a tensor without one."""
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


class SavedBytes:
    """A pack hook that charges each storage autograd saves once, to :attr:`current` (a
    node name), skipping the ``params`` storage identities (:func:`storage_key`)."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.current = ""
        self.saved: dict[str, int] = {}
        """Node name -> bytes saved for backward by its forward."""
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key[0] not in self._seen and key[0] not in self.params:
            self._seen.add(key[0])
            self.saved[self.current] = self.saved.get(self.current, 0) + key[1]
        return t


class _Counter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, counter: SavedBytes) -> None:
        super().__init__(gm)
        self.counter = counter

    def run_node(self, n: torch.fx.Node) -> object:
        self.counter.current = n.name
        return super().run_node(n)


def static_saved_bytes(gm: torch.fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Bytes each node of ``gm`` saves for backward in training mode, counted as a CPU
    worker's profile counts them, without data or weights.

    ``gm``'s parameters and the inputs may live on any device, the meta device included
    (only their shapes and dtypes are read); ``gm`` is not changed.

    Raises:
        RuntimeError: a node's output shape depends on the values (it cannot run on fake
            tensors).
    """
    module = copy.deepcopy(gm)
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}  # tied parameters stay tied
    with mode:
        for m in module.modules():
            for table, make in ((m._parameters, _fake_parameter), (m._buffers, _fake_buffer)):
                for name, value in list(table.items()):
                    if value is not None:
                        table[name] = fakes.setdefault(id(value), make(value))
        inputs = tuple(torch.zeros(x.shape, dtype=x.dtype, device="cpu") for x in example_inputs)
    module.train()
    params = {k[0] for p in module.parameters() if (k := storage_key(p)) is not None}
    counter = SavedBytes(params)
    with mode, torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        _Counter(module, counter).run(*inputs)
    return counter.saved


def with_static_saved_bytes(dag: OpDag, gm: torch.fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]) -> OpDag:
    """``dag`` (captured from ``gm``) with every compute node's saved bytes from
    :func:`static_saved_bytes`; a graph that cannot run on fake tensors keeps the estimator's
    fallback (a node's output bytes), with a warning that says so."""
    try:
        saved = static_saved_bytes(gm, example_inputs)
    except Exception as e:  # a data-dependent shape, or an op without a fake kernel
        logger.warning(
            "could not count the activations the model saves without data (%s: %s); "
            "estimating each node's as its output bytes",
            type(e).__name__,
            e,
        )
        return dag
    compute = {n.name for n in dag.compute_nodes()}
    nodes = [dataclasses.replace(n, saved_bytes=saved.get(n.name, 0)) if n.name in compute else n for n in dag.nodes]
    return dataclasses.replace(dag, nodes=nodes)


def _fake_parameter(p: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)


def _fake_buffer(b: torch.Tensor) -> torch.Tensor:
    return torch.zeros(b.shape, dtype=b.dtype, device="cpu")
