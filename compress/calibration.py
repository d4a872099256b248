"""Calibration: how much each codec setting distorts the tensors a job would send.

Before training, the coordinator runs one micro-batch of the job's own model forward and
backward (:func:`capture_cut_tensors`) and keeps, for every compute node, its output (the
activation that would cross a cut placed after it) and the gradient of the loss with
respect to that output (what would cross back). :func:`calibrate` then encodes and decodes
each tensor with every candidate setting and records

- the relative error ``e = ||x - decode(encode(x))|| / ||x||`` (0 for a zero tensor),
- the bytes ratio ``len(encode(x)) / dense_bytes(x)``, and
- the codec's seconds per dense byte, ``(t_encode + 2 t_decode) / dense_bytes(x)``: what a
  compressed tensor costs the executor (the sender encodes, and decodes to keep the error
  and the feedback residual; the receiver decodes), timed here on the calibrating machine.
  The codecs are elementwise passes over memory, so their speed is taken as it is measured,
  not scaled by the workers' matmul speeds as node times are,

per node and direction. The result is plain data (:class:`Calibration`, JSON-able) that the
scheduler's convergence model reads (:mod:`scheduler.convergence`); nothing here decides.

Gradients are encoded once, without the error feedback the executor adds during training
(its residual is empty on the first step): ``e`` is the one-shot distortion of a setting,
which feedback later spreads over steps rather than removes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from compress.base import get_compressor
from fusion.config import JobSpec
from fusion.job_sections import COMPRESSION_CANDIDATES
from fusion.losses import get_loss
from fusion.training import example_micro_batch

logger = logging.getLogger(__name__)

#: Candidate settings (:data:`fusion.job_sections.COMPRESSION_CANDIDATES`).
CANDIDATES = COMPRESSION_CANDIDATES

#: Entries of a tensor calibrated at most: a contiguous leading slice of the flattened tensor
#: (whole quantization blocks, the same value distribution), so that the cost stays bounded.
MAX_ELEMENTS = 1 << 16
#: What :func:`measure_setting` returns, in order: each a key of a node's entry after its
#: direction (``activation_error``, ``gradient_codec_s_per_byte``, ...).
MEASURED = ("error", "bytes_ratio", "codec_s_per_byte")
#: Nodes calibrated at most (evenly spaced in topological order); the others fall back to
#: the scheduler's prior. Bounds the calibration of very large graphs.
MAX_NODES = 512


@dataclass
class Calibration:
    """Measured distortion per node, direction and candidate setting (index-aligned lists)."""

    settings: list[tuple[str, float, int]] = field(default_factory=lambda: list(CANDIDATES))
    """The candidate settings, ``(codec, keep_ratio, bits)``."""
    nodes: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Node name -> ``{"activation_error", "gradient_error", "activation_bytes_ratio",
    "gradient_bytes_ratio", "activation_codec_s_per_byte", "gradient_codec_s_per_byte"}``,
    each a list aligned with :attr:`settings`. A node whose output has no gradient (an
    integer tensor, a value off the loss's path) has no gradient lists."""

    def to_dict(self) -> dict[str, Any]:
        return {"settings": [list(s) for s in self.settings], "nodes": self.nodes}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Calibration:
        return Calibration(
            settings=[(str(c), float(r), int(b)) for c, r, b in d["settings"]],
            nodes={str(k): {str(n): [float(x) for x in v] for n, v in e.items()} for k, e in d["nodes"].items()},
        )


def relative_error(tensor: torch.Tensor, codec: str, keep_ratio: float, bits: int) -> tuple[float, float]:
    """``(||x - x_hat|| / ||x||, encoded bytes / dense bytes)`` of one setting on ``tensor``."""
    rel, ratio, _ = measure_setting(tensor, codec, keep_ratio, bits)
    return rel, ratio


def measure_setting(tensor: torch.Tensor, codec: str, keep_ratio: float, bits: int) -> tuple[float, float, float]:
    """:func:`relative_error` and the codec's seconds per dense byte (module docstring)."""
    x = tensor.detach()
    dense_bytes = x.numel() * x.element_size()
    if codec == "none" or x.numel() < 2 or dense_bytes == 0:
        return 0.0, 1.0, 0.0
    compressor = get_compressor(codec)
    t0 = time.perf_counter()
    enc = compressor.encode(x, keep_ratio=min(1.0, keep_ratio), bits=bits or 8)
    t1 = time.perf_counter()
    x_hat = compressor.decode(enc.data, dtype=x.dtype, shape=tuple(x.shape)).to(x.device)
    t2 = time.perf_counter()
    norm = float(torch.linalg.vector_norm(x.float()))
    err = float(torch.linalg.vector_norm((x - x_hat).float()))
    rel = 0.0 if norm == 0.0 or not math.isfinite(norm) else min(err / norm, 1.0e6)
    return rel, enc.size_bytes / dense_bytes, ((t1 - t0) + 2 * (t2 - t1)) / dense_bytes


def calibrate(
    activations: Mapping[str, torch.Tensor],
    gradients: Mapping[str, torch.Tensor],
    settings: Sequence[tuple[str, float, int]] = CANDIDATES,
) -> Calibration:
    """Encode every tensor with every setting and record its relative error and bytes ratio.

    ``activations`` and ``gradients`` are by node name (a gradient's node must also have an
    activation). Integer and empty tensors are left out (they always travel dense); of a
    larger tensor the first :data:`MAX_ELEMENTS` entries stand for it.
    """
    out = Calibration(settings=list(settings))
    for name, act in activations.items():
        if not act.is_floating_point() or act.numel() < 2:
            continue
        act = act.reshape(-1)[:MAX_ELEMENTS]
        grad = gradients.get(name)
        grad = None if grad is None else grad.reshape(-1)[:MAX_ELEMENTS]
        tensors = {"activation": act} if grad is None else {"activation": act, "gradient": grad}
        entry: dict[str, list[float]] = {f"{d}_{key}": [] for d in tensors for key in MEASURED}
        for codec, ratio, bits in settings:
            for d, t in tensors.items():
                for key, v in zip(MEASURED, measure_setting(t, codec, ratio, bits), strict=True):
                    entry[f"{d}_{key}"].append(v)
        out.nodes[name] = entry
    return out


class _Recorder(fx.Interpreter):
    """Runs a graph module and keeps the output of the chosen nodes (gradients retained)."""

    def __init__(self, module: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(module)
        self.keep = keep
        self.outputs: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.name in self.keep and isinstance(value, torch.Tensor):
            if value.requires_grad:
                value.retain_grad()
            self.outputs[n.name] = value
        return value


def capture_cut_tensors(
    graph_module: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    nodes: Iterable[str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward and backward of ``graph_module``: each named node's output and its gradient.

    The module is left as it was, so a model about to be trained is not disturbed: its
    parameter gradients and buffers (batch-norm statistics) are restored afterwards, and the
    global random state (dropout) is forked.
    """
    keep = set(nodes)
    saved = {n: p.grad for n, p in graph_module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in graph_module.named_buffers()}
    recorder = _Recorder(graph_module, keep)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            output = recorder.run(*inputs)
            loss = loss_fn(output, target)
            if loss.requires_grad:
                loss.backward()
        acts = {n: t.detach() for n, t in recorder.outputs.items()}
        grads = {n: t.grad.detach() for n, t in recorder.outputs.items() if t.grad is not None}
    finally:
        for n, p in graph_module.named_parameters():
            p.grad = saved.get(n)
        with torch.no_grad():
            for n, b in graph_module.named_buffers():
                b.copy_(buffers[n])
    return acts, grads


def calibrate_model(
    graph_module: fx.GraphModule,
    node_names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    settings: Sequence[tuple[str, float, int]] = CANDIDATES,
    max_nodes: int = MAX_NODES,
) -> Calibration:
    """:func:`capture_cut_tensors` then :func:`calibrate`, over at most ``max_nodes`` of
    ``node_names`` (evenly spaced in the given order)."""
    names = list(node_names)
    if len(names) > max_nodes:
        step = len(names) / max_nodes
        names = [names[int(i * step)] for i in range(max_nodes)]
    acts, grads = capture_cut_tensors(graph_module, inputs, target, loss_fn, names)
    table = calibrate(acts, grads, settings)
    logger.info("calibrated %d settings on %d node outputs", len(table.settings), len(table.nodes))
    return table


class JobCalibrator:
    """Calibrates a job's codecs on demand, node by node, remembering what it measured.

    Holds one micro-batch of the job (its first) and the captured model; :meth:`table`
    measures only the nodes not measured yet, so planning again after a failure pays only
    for the new cuts.
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        settings: Sequence[tuple[str, float, int]] = CANDIDATES,
    ) -> None:
        self.graph_module = graph_module
        self.inputs = tuple(inputs)
        self.target = target
        self.loss_fn = loss_fn
        self.calibration = Calibration(settings=list(settings))

    def table(self, nodes: Iterable[str]) -> dict[str, Any]:
        """The calibration (``Calibration.to_dict``) covering at least ``nodes``."""
        missing = [n for n in nodes if n not in self.calibration.nodes]
        if missing:
            more = calibrate_model(
                self.graph_module, missing, self.inputs, self.target, self.loss_fn, settings=self.calibration.settings
            )
            self.calibration.nodes.update(more.nodes)
        return self.calibration.to_dict()


def job_calibrator(job: JobSpec, captured: Any, dataset: Any) -> JobCalibrator:
    """A calibrator on the job's first micro-batch (``captured``: the job's
    :class:`~fusion.graph.export.CapturedModel`, its weights the model's initial ones)."""
    x, y = example_micro_batch(job, dataset)
    return JobCalibrator(captured.graph_module, (x,), y, get_loss(job.train.loss))
