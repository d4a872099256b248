"""A loaded stage's tensors by name, read and written between steps (``GetState``,
``SetState``): its parameters and buffers, its parameter gradients, its compression
residuals. Kept apart from :mod:`executor.runtime`, which runs steps: these only look a name
up in the stage's module and check or copy a tensor."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor.transport import dtype_from_wire
from fusion.errors import NotFoundError, WireError
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb


def read_state(
    module: torch.nn.Module, residuals: Mapping[str, torch.Tensor], stage_idx: int, kind: int, names: list[str]
) -> dict[str, torch.Tensor]:
    """Parameters and buffers (``STATE_KIND_PARAMETERS``), parameter gradients or
    ``residuals`` by name, on the CPU (all of them for no ``names``)."""
    if kind == epb.STATE_KIND_PARAMETERS:
        available = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
    elif kind == epb.STATE_KIND_GRADIENTS:
        available = {
            k: p.grad.detach() for k, p in module.named_parameters(remove_duplicate=False) if p.grad is not None
        }
    elif kind == epb.STATE_KIND_RESIDUALS:
        available = dict(residuals)
    else:
        raise WireError(f"unknown state kind {kind}")
    if not names:
        return {k: v.cpu() for k, v in available.items()}
    missing = [n for n in names if n not in available]
    if missing and kind == epb.STATE_KIND_PARAMETERS:
        raise NotFoundError(f"stage {stage_idx} holds no tensor named {missing[:5]}")
    return {n: available[n].cpu() for n in names if n in available}


def check_state_header(module: torch.nn.Module, stage_idx: int, kind: int, header: pb.TransferHeader) -> None:
    """Validate a SetState header: known names, matching dtypes and shapes."""
    params = dict(module.state_dict(keep_vars=True))
    if kind == pb.TRANSFER_KIND_PARAMETER_GRADIENT:
        params = dict(module.named_parameters(remove_duplicate=False))
    elif kind != pb.TRANSFER_KIND_PARAMETER:
        raise WireError(f"transfer kind {kind} cannot set stage state")
    for meta in header.tensors:
        target = params.get(meta.name)
        if target is None:
            raise NotFoundError(f"stage {stage_idx} holds no tensor named {meta.name!r}")
        dtype = dtype_from_wire(meta.dtype)
        if dtype != target.dtype or tuple(meta.shape) != tuple(target.shape):
            raise WireError(
                f"tensor {meta.name!r} is {dtype}{list(meta.shape)}, the stage holds {target.dtype}{list(target.shape)}"
            )


def write_state(
    module: torch.nn.Module, device: torch.device | str, kind: int, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Copy parameters/buffers in (``TRANSFER_KIND_PARAMETER``), or set parameter gradients."""
    with torch.no_grad():
        if kind == pb.TRANSFER_KIND_PARAMETER:
            sd = module.state_dict(keep_vars=True)
            for name, t in tensors.items():
                sd[name].copy_(t)
        else:
            params = dict(module.named_parameters(remove_duplicate=False))
            for name, t in tensors.items():
                params[name].grad = t.to(device).clone()
