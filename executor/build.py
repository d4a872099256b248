"""Build a stage on a worker from a ``LoadStageRequest``: no code crosses the wire.

The worker builds the model itself from the job's model spec (a built-in name and its
config, or a ``module:factory`` the worker operator allowed), captures it exactly as the
coordinator did, checks that the graph fingerprints agree, and cuts out the stage from the
node list in the request. Parameters arrive afterwards as tensors (``SetState``).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from dataclasses import dataclass

import torch

from executor.mailbox import ExpectedValue
from executor.micro_batch import TARGET_NAME
from executor.transport import dtype_from_wire
from fusion.config import TrainSpec
from fusion.devices import use_exact_fp32
from fusion.errors import AuthError, ConfigError, GraphExportError, WireError
from fusion.graph.export import capture_graph, graph_fingerprint
from fusion.graph.split import StageSpec, build_stage_module
from fusion.wire import executor_pb2 as epb

logger = logging.getLogger(__name__)


@dataclass
class BuiltStage:
    """What :func:`build_stage` produces for the runtime."""

    spec: StageSpec
    module: torch.fx.GraphModule
    expected: dict[str, ExpectedValue]
    train: TrainSpec
    device: torch.device


def parse_device(text: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``ConfigError`` if unavailable here.

    Every stage's device comes through here, so this is also where a CUDA worker turns
    TF32 off (:func:`fusion.devices.use_exact_fp32`).
    """
    try:
        device = torch.device(text or "cpu")
    except RuntimeError as e:
        raise ConfigError(f"invalid device {text!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {text!r} requested but CUDA is not available on this worker")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {text!r} is not supported; use cpu or cuda[:N]")
    use_exact_fp32(device)
    return device


def expected_value(spec: epb.ValueSpec) -> ExpectedValue:
    """The wire expectation for one boundary value."""
    if spec.kind == "tensor":
        return ExpectedValue(kind="tensor", dtype=dtype_from_wire(spec.dtype), shape=tuple(spec.shape))
    return ExpectedValue(kind=spec.kind)


def example_inputs(specs: list[epb.ValueSpec]) -> list[torch.Tensor]:
    """Zero tensors shaped like the example inputs (only their shapes matter to capture)."""
    return [torch.zeros(tuple(s.shape), dtype=dtype_from_wire(s.dtype)) for s in specs]


def build_stage(request: epb.LoadStageRequest, *, allow_code: bool, graphs: GraphCache | None = None) -> BuiltStage:
    """Build, capture and cut the stage the request describes.

    Raises:
        AuthError: the model is a ``module:factory`` and the worker does not allow user code.
        ConfigError: the model spec, device or training section is invalid.
        GraphExportError: capture failed, or the graph differs from the coordinator's.
    """
    try:
        train = TrainSpec.from_dict(json.loads(request.train_json or "{}"))
    except json.JSONDecodeError as e:
        raise WireError(f"LoadStage carries malformed JSON: {e}") from e
    device = parse_device(request.device)
    if graphs is not None:
        gm = graphs.get(request.model, list(request.example_inputs), seed=train.seed, allow_code=allow_code)
    else:
        gm = build_model_graph(request.model, list(request.example_inputs), seed=train.seed, allow_code=allow_code)
    fingerprint = graph_fingerprint(gm)
    if request.graph_fingerprint and fingerprint != request.graph_fingerprint:
        raise GraphExportError(
            f"this worker captured a different graph (fingerprint {fingerprint}, "
            f"coordinator {request.graph_fingerprint}); "
            f"check that worker and coordinator run the same torch ({torch.__version__}) and fusion versions"
        )
    nodes = {n.name: n for n in gm.graph.nodes}
    unknown = [n for n in request.nodes if n not in nodes]
    if unknown:
        raise WireError(f"LoadStage names nodes the graph does not have: {unknown[:5]}")
    attrs: dict[str, None] = {}
    for name in request.nodes:
        for inp in nodes[name].all_input_nodes:
            if inp.op == "get_attr":
                attrs[inp.name] = None
    spec = StageSpec(
        stage_idx=request.stage_idx,
        nodes=tuple(request.nodes),
        attrs=tuple(attrs),
        inputs=tuple((i.name, i.src_stage_idx) for i in request.inputs),
        outputs=tuple((o.name, tuple(o.dst_stage_idx)) for o in request.outputs),
        is_loss_stage=request.is_loss_stage,
        depth=request.depth,
    )
    module = build_stage_module(gm, spec).to(device)
    module.train()
    expected = {v.name: expected_value(v) for v in request.values}
    boundary = [n for n, _ in spec.inputs] + [n for n, _ in spec.outputs]
    if spec.is_loss_stage:
        boundary.append(TARGET_NAME)
    missing = [n for n in boundary if n not in expected]
    if missing:
        raise WireError(f"LoadStage lacks the expected shapes of boundary values {missing[:5]}")
    return BuiltStage(spec=spec, module=module, expected=expected, train=train, device=device)


class GraphCache:
    """The most recently captured model graph, so reloading a job's stages is quick.

    Building and tracing a large model takes seconds to tens of seconds; a re-plan or a
    recovery reloads every stage, and a spare can capture ahead of time (``AdmitJob``). One
    entry (one model copy in memory); every caller gets its own deep copy, so stages never
    share parameters with each other or with the cache.
    """

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._gm: torch.fx.GraphModule | None = None
        self._lock = threading.Lock()

    def get(
        self, model_spec: epb.ModelSpec, inputs: list[epb.ValueSpec], *, seed: int, allow_code: bool
    ) -> torch.fx.GraphModule:
        key = b"\0".join(
            [
                model_spec.SerializeToString(deterministic=True),
                *(v.SerializeToString(deterministic=True) for v in inputs),
                str(seed).encode(),
            ]
        )
        with self._lock:  # one capture at a time; a second caller for the same model waits and copies
            if self._key != key or self._gm is None:
                self._gm = build_model_graph(model_spec, inputs, seed=seed, allow_code=allow_code)
                self._key = key
            return copy.deepcopy(self._gm)


def build_model_graph(
    model_spec: epb.ModelSpec, inputs: list[epb.ValueSpec], *, seed: int, allow_code: bool
) -> torch.fx.GraphModule:
    """Build the job's model from its spec (seeded) and capture it as the coordinator did.

    Raises:
        AuthError: the model is a ``module:factory`` and the worker does not allow user code.
        WireError: the keyword arguments are not a JSON object.
    """
    from fusion.models import build_model

    if ":" in model_spec.name and not allow_code:
        raise AuthError(
            f"model {model_spec.name!r} is user code; this worker only runs built-in models. "
            "Start the worker with --allow-code to import job owners' factories."
        )
    try:
        kwargs = json.loads(model_spec.kwargs_json or "{}")
    except json.JSONDecodeError as e:
        raise WireError(f"model.kwargs_json is malformed JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise WireError("model.kwargs_json must be a JSON object")
    torch.manual_seed(seed)
    model = build_model(model_spec.name, model_spec.preset or None, **kwargs)
    gm, _ = capture_graph(model, example_inputs(inputs), leaf_modules=list(model_spec.leaf_modules))
    return gm
