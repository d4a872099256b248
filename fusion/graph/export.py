"""Capture a model as an fx graph and describe it as an :class:`~fusion.graph.ir.OpDag`.

Capture tries ``torch.fx.symbolic_trace`` first: it keeps module-level nodes
(``transformer.h.0.attn``) whose names people recognise, and it does not specialise on
shapes. Models with Python control flow on tensors (``if x.dim() == 4``, ``if x.size(1) > n``
— common in models from popular libraries) cannot be traced symbolically; they fall back to
``torch.export`` (non-strict), whose ATen-level graph is an fx graph too and is specialised
to the example input shapes. A block that neither can capture can be kept whole as a
*leaf module* (fx runs it as one opaque node).

Workers re-capture the model from its spec rather than receiving code, so capture must be
deterministic: :func:`graph_fingerprint` hashes the structure and both sides compare it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from fusion.errors import GraphExportError
from fusion.graph.ir import OpDag, OpEdge, OpNode, ValueMeta

logger = logging.getLogger(__name__)

_CAPTURE_LOCK = threading.Lock()

#: Bytes charged for a non-tensor value crossing a boundary (it travels as a protobuf field).
SCALAR_BYTES = 8


@dataclass
class CapturedModel:
    """A captured graph module together with its OP-DAG description."""

    graph_module: fx.GraphModule
    """The runnable captured graph; its ``state_dict`` names are the original model's."""
    dag: OpDag
    """The costed description of ``graph_module``."""


class _LeafTracer(fx.Tracer):
    """An fx tracer that keeps named modules whole and remembers where tracing failed."""

    def __init__(self, leaf_modules: Iterable[str]) -> None:
        super().__init__()
        self.leaf_names = frozenset(leaf_modules)
        self.failed_in: str | None = None

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaf_names or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # innermost module wins: it fails first
                self.failed_in = self.path_of_module(m)
            raise


def capture_graph(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    leaf_modules: Iterable[str] = (),
) -> tuple[fx.GraphModule, str]:
    """Capture ``model`` as an fx ``GraphModule``: symbolic tracing, then torch.export.

    Returns:
        The graph module and the capture method (``"fx"`` or ``"export"``).

    Raises:
        GraphExportError: neither method could capture the model; the message names the
            module where tracing failed and suggests ``leaf_modules``.
    """
    leaf_modules = tuple(leaf_modules)
    _check_leaf_modules(model, leaf_modules)
    # Tracing patches process-wide hooks (Module.__call__ and friends): one capture at a time.
    with _CAPTURE_LOCK:
        return _capture_locked(model, example_inputs, leaf_modules)


def _capture_locked(
    model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], leaf_modules: tuple[str, ...]
) -> tuple[fx.GraphModule, str]:
    tracer = _LeafTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
        return gm, "fx"
    except Exception as e:  # any tracing failure leads to the fallback
        fx_error = e
        failed_in = tracer.failed_in or "<top level>"
        logger.info("symbolic_trace failed in %s (%s); falling back to torch.export", failed_in, fx_error)
    try:
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
        gm = ep.module()
    except Exception as export_error:
        hint = (
            f"keep that module whole as one node: add `leaf_modules = [{json.dumps(failed_in)}]` under [model] in "
            f"the job file (from Python: fusion.export(..., leaf_modules=[{failed_in!r}]))"
            if failed_in != "<top level>"
            else "move the untraceable code into a submodule and name it in `leaf_modules = [...]` under [model] "
            "in the job file (from Python: fusion.export(..., leaf_modules=[...]))"
        )
        raise GraphExportError(
            f"cannot capture {type(model).__name__}: torch.fx.symbolic_trace failed in module "
            f"{failed_in!r} ({fx_error}) and torch.export failed too "
            f"({type(export_error).__name__}: {str(export_error).splitlines()[0] if str(export_error) else ''}); "
            f"{hint}"
        ) from export_error
    _strip_export_guards(gm)
    return gm, "export"


def _check_leaf_modules(model: torch.nn.Module, leaf_modules: Sequence[str]) -> None:
    names = {name for name, _ in model.named_modules()}
    unknown = [m for m in leaf_modules if m not in names]
    if unknown:
        raise GraphExportError(
            f"leaf_modules names unknown module(s) {unknown}; valid names look like {sorted(names)[1:6]}"
        )


def _strip_export_guards(gm: fx.GraphModule) -> None:
    """Make a torch.export module a plain fx graph: positional inputs, a bare output.

    Drops the input-shape guard call (the executor checks shapes on the wire itself) and
    the pytree calling convention, and unwraps a one-element output tuple.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
    gm.graph._codegen = fx.graph.CodeGen()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    if isinstance(value, (tuple, list)) and len(value) == 1:
        out.args = (value[0],)
    gm.graph.lint()
    gm.recompile()


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    leaf_modules: Iterable[str] = (),
) -> OpDag:
    """Export ``model`` as a costed :class:`OpDag` (see :func:`capture`)."""
    return capture(model, example_inputs, leaf_modules=leaf_modules).dag


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    leaf_modules: Iterable[str] = (),
) -> CapturedModel:
    """Capture ``model`` and describe every node: values, owned parameters, FLOPs, edges.

    Shape propagation runs the graph once on ``example_inputs`` (without gradients). The
    model's buffers and the global RNG state are restored afterwards, so capturing does not
    change what training would do next.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    gm, method = capture_graph(model, example_inputs, leaf_modules=leaf_modules)
    values, flops = _propagate(gm, example_inputs)
    dag = _describe(model, gm, values, flops, method)
    return CapturedModel(graph_module=gm, dag=dag)


def describe_value(value: Any) -> ValueMeta:
    """Classify a runtime value into the kinds the wire knows (see :class:`ValueMeta`)."""
    if isinstance(value, torch.Tensor):
        return ValueMeta(
            kind="tensor",
            dtype=str(value.dtype).removeprefix("torch."),
            shape=tuple(int(s) for s in value.shape),
            size_bytes=value.numel() * value.element_size(),
        )
    if isinstance(value, bool):
        return ValueMeta(kind="bool", size_bytes=SCALAR_BYTES)
    if isinstance(value, int):
        return ValueMeta(kind="int", size_bytes=SCALAR_BYTES)
    if isinstance(value, float):
        return ValueMeta(kind="float", size_bytes=SCALAR_BYTES)
    if value is None:
        return ValueMeta(kind="none", size_bytes=0)
    if isinstance(value, torch.dtype):
        return ValueMeta(kind="dtype", size_bytes=SCALAR_BYTES)
    if isinstance(value, torch.device):
        return ValueMeta(kind="device", size_bytes=SCALAR_BYTES)
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ValueMeta(kind="ints", shape=(len(value),), size_bytes=SCALAR_BYTES * len(value))
    if isinstance(value, (tuple, list)):
        return ValueMeta(kind="tuple", size_bytes=sum(describe_value(v).size_bytes for v in value))
    return ValueMeta(kind="other", size_bytes=0)


def _skip_the_dynamo_import() -> None:
    """Spare each process the 2 s of CPU that its first FLOP count would spend importing
    ``torch._dynamo``.

    torch wraps every dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
    whose first call imports ``torch._dynamo`` only to mark the function as never to be
    compiled, and caches that answer on the function as ``__dynamo_disable``. Capture never
    runs under ``torch.compile``, so the answer is the function itself: cache that. Where a
    torch release no longer wraps the mode this does nothing (``__wrapped__`` is absent)."""
    raw = getattr(_FlopCounterMode.__torch_dispatch__, "__wrapped__", None)
    if raw is not None and getattr(raw, "__dynamo_disable", None) is None:
        raw.__dynamo_disable = raw


_skip_the_dynamo_import()


class _Propagator(fx.Interpreter):
    """Runs the graph once, recording each node's output and its forward FLOPs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, ValueMeta] = {}
        self.flops: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(n)
        meta = describe_value(result)
        self.values[n.name] = meta
        flops = int(counter.get_total_flops())
        if flops == 0 and meta.kind == "tensor" and n.op in ("call_function", "call_method", "call_module"):
            # The counter only knows matmul-like ops; charge elementwise work one FLOP per
            # output element so that the cost model does not think it is free.
            flops = math.prod(meta.shape or ())
        self.flops[n.name] = flops
        return result


def _propagate(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]
) -> tuple[dict[str, ValueMeta], dict[str, int]]:
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        with torch.no_grad():
            prop = _Propagator(gm)
            prop.run(*example_inputs)
    except Exception as e:
        raise GraphExportError(f"running the captured graph on the example inputs failed: {e}") from e
    finally:
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
    return prop.values, prop.flops


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        # torch.export spells nested paths with "L['self'].a.b"-like prefixes in some versions.
        return str(path).removeprefix("L['self'].").removeprefix("L__self__.")
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return ""


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    module = getattr(t, "__module__", None)
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return f"{module}.{name}" if module and module not in ("builtins", "_operator") else str(name)


def _owned_state(gm: fx.GraphModule, node: fx.Node) -> tuple[dict[str, int], dict[str, int]]:
    params: dict[str, int] = {}
    buffers: dict[str, int] = {}
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for name, p in module.named_parameters(remove_duplicate=False):
            params[f"{node.target}.{name}"] = p.numel() * p.element_size()
        for name, b in module.named_buffers(remove_duplicate=False):
            buffers[f"{node.target}.{name}"] = b.numel() * b.element_size()
    elif node.op == "get_attr":
        owner_path, _, attr = str(node.target).rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if attr in owner._parameters:
            p = owner._parameters[attr]
            params[str(node.target)] = p.numel() * p.element_size()
        elif attr in owner._buffers and owner._buffers[attr] is not None:
            b = owner._buffers[attr]
            buffers[str(node.target)] = b.numel() * b.element_size()
    return params, buffers


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the graph structure: node names, kinds, targets and inputs, in order."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        inputs = ",".join(i.name for i in n.all_input_nodes)
        h.update(f"{n.name}|{n.op}|{_target_name(n)}|{inputs}\n".encode())
    return h.hexdigest()[:16]


def tied_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Map every alias of a shared parameter to its canonical (first-registered) name."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        if first != name:
            aliases[name] = first
    return aliases


def _describe(
    model: torch.nn.Module,
    gm: fx.GraphModule,
    values: dict[str, ValueMeta],
    flops: dict[str, int],
    method: str,
) -> OpDag:
    nodes: list[OpNode] = []
    edges: list[OpEdge] = []
    output_name = ""
    for n in gm.graph.nodes:
        inputs = list(dict.fromkeys(i.name for i in n.all_input_nodes))
        params, buffers = _owned_state(gm, n)
        value = values.get(n.name, ValueMeta(kind="none"))
        if n.op == "output":
            out_args = n.args[0]
            if not isinstance(out_args, fx.Node):
                raise GraphExportError(
                    "the model must return a single tensor (the output the loss is computed from); "
                    f"it returns {type(out_args).__name__}. Wrap it to return only the logits."
                )
            output_name = out_args.name
            value = values.get(output_name, value)
        fwd = flops.get(n.name, 0)
        nodes.append(
            OpNode(
                name=n.name,
                op=n.op,
                target=_target_name(n),
                inputs=inputs,
                params=params,
                buffers=buffers,
                value=value,
                flops_fwd=fwd,
                flops_bwd=2 * fwd,
                module_path=_module_path(n),
            )
        )
        for src in inputs:
            meta = values.get(src)
            size = meta.size_bytes if meta is not None else 0
            differentiable = (
                meta is not None and meta.kind == "tensor" and (meta.dtype or "").startswith(("float", "bfloat"))
            )
            edges.append(OpEdge(src=src, dst=n.name, bytes=size, grad_bytes=size if differentiable else 0))
    if not output_name:
        raise GraphExportError("the captured graph has no output node")
    tied = tied_parameter_names(model)
    return OpDag(
        nodes=nodes,
        edges=edges,
        output=output_name,
        capture=method,
        fingerprint=graph_fingerprint(gm),
        tied_params=tied,
    )
