"""A stage's whole training state as one flat, name-keyed dict of tensors, and back.

Keys (``TensorState``):

- ``param/<name>``: parameters and buffers, under the model's original ``state_dict`` names;
- ``optim/<name>/<key>``: per-parameter optimizer state (AdamW's ``step``, ``exp_avg``,
  ``exp_avg_sq``; SGD's ``momentum_buffer``);
- ``residual/<key>``: error-feedback residuals of the stage's compressed cuts;
- ``rng/cpu`` (and ``rng/cuda``): the generator state.

The keys are names, not the positions ``Optimizer.state_dict`` uses, so the states of the
stages of one plan merge into a whole-model state (:func:`merge_states`) that splits again
along another plan (:func:`stage_subset`). That is what lets a job re-plan onto fewer or
more workers and still continue exactly where it was.

Capture comes in two halves because they change at different times: buffers (batch-norm
statistics), residuals and the RNG change during the next forward pass, so
:func:`capture_volatile` must run before it starts; parameters and optimizer state change
only at the next optimizer step, so :func:`capture_weights` may copy them in the background
while the next step computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from fusion.errors import CheckpointError

TensorState = dict[str, torch.Tensor]

PARAM = "param/"
OPTIM = "optim/"
RESIDUAL = "residual/"
RNG = "rng/"


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def capture_volatile(module: torch.nn.Module, residuals: Mapping[str, torch.Tensor] | None = None) -> TensorState:
    """Buffers, residuals and RNG state: what the next forward pass changes."""
    out: TensorState = {PARAM + name: _copy(b) for name, b in module.named_buffers()}
    for key, t in (residuals or {}).items():
        out[RESIDUAL + key] = _copy(t)
    out[RNG + "cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and any(p.is_cuda for p in module.parameters()):
        out[RNG + "cuda"] = torch.cuda.get_rng_state()
    return out


def capture_weights(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = True) -> TensorState:
    """Parameters and their optimizer state: what only the next optimizer step changes.

    ``copy=False`` returns the live tensors (detached): for a caller that serialises them
    before letting the optimizer run again, which saves one full copy of the stage.
    """
    take = _copy if copy else (lambda t: t.detach())
    out: TensorState = {}
    with torch.no_grad():
        copies: dict[int, torch.Tensor] = {}
        for name, p in module.named_parameters(remove_duplicate=False):  # tied names each get an entry
            out[PARAM + name] = copies.setdefault(id(p), take(p))
        for name, p in module.named_parameters():
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPTIM}{name}/{key}"] = take(value)
                elif isinstance(value, (int, float)):
                    out[f"{OPTIM}{name}/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return out


def restore_state(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, torch.Tensor],
    *,
    load_residuals: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
    restore_rng: bool = True,
) -> None:
    """Put ``state`` into a freshly loaded stage; checks every name, shape and dtype first.

    Raises:
        CheckpointError: a parameter or buffer is missing, or does not match the stage.
    """
    targets = module.state_dict(keep_vars=True)
    missing = [n for n in targets if PARAM + n not in state]
    if missing:
        raise CheckpointError(f"snapshot lacks {len(missing)} tensor(s) the stage holds, e.g. {missing[:3]}")
    for name, target in targets.items():
        t = state[PARAM + name]
        if t.shape != target.shape or t.dtype != target.dtype:
            raise CheckpointError(
                f"snapshot tensor {name!r} is {t.dtype}{list(t.shape)}, "
                f"the stage holds {target.dtype}{list(target.shape)}"
            )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state[PARAM + name])
    optimizer.state.clear()
    for name, p in module.named_parameters():
        prefix = f"{OPTIM}{name}/"
        entries = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if entries:
            # AdamW keeps ``step`` on the CPU unless it is capturable; everything else lives with p.
            optimizer.state[p] = {
                k: (v.clone() if k == "step" else v.to(p.device, copy=True)) for k, v in entries.items()
            }
    if load_residuals is not None:
        load_residuals({k[len(RESIDUAL) :]: v for k, v in state.items() if k.startswith(RESIDUAL)})
    if restore_rng and RNG + "cpu" in state:
        torch.set_rng_state(state[RNG + "cpu"])
        if RNG + "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state[RNG + "cuda"])


def merge_states(states: Iterable[Mapping[str, torch.Tensor]], canonical: Callable[[str], str]) -> TensorState:
    """The whole model's parameters, buffers and optimizer state from its stages' states.

    Shared (tied) parameters appear on several stages under possibly different names;
    ``canonical`` maps each to one name (they hold equal values: their gradients are summed
    before every step). Residuals and RNG belong to cuts and processes, not the model, and
    are dropped.
    """
    whole: TensorState = {}
    for state in states:
        for key, t in state.items():
            if key.startswith(PARAM):
                whole.setdefault(PARAM + canonical(key[len(PARAM) :]), t)
            elif key.startswith(OPTIM):
                name, _, slot = key[len(OPTIM) :].rpartition("/")
                whole.setdefault(f"{OPTIM}{canonical(name)}/{slot}", t)
    return whole


def stage_subset(
    whole: Mapping[str, torch.Tensor], names: Iterable[str], canonical: Callable[[str], str]
) -> TensorState:
    """The part of a whole-model state that a stage holding ``names`` needs, under its names."""
    out: TensorState = {}
    for name in names:
        c = canonical(name)
        if PARAM + c in whole:
            out[PARAM + name] = whole[PARAM + c]
        prefix = f"{OPTIM}{c}/"
        for key, t in whole.items():
            if key.startswith(prefix):
                out[f"{OPTIM}{name}/{key[len(prefix) :]}"] = t
    return out


def model_state(state_dict: Mapping[str, torch.Tensor]) -> TensorState:
    """A whole-model state with no optimizer state yet: a job's step 0."""
    return {PARAM + name: t for name, t in state_dict.items()}


def parameters_of(state: Mapping[str, torch.Tensor]) -> TensorState:
    """The ``state_dict`` inside a state (``param/`` entries, prefix removed)."""
    return {k[len(PARAM) :]: t for k, t in state.items() if k.startswith(PARAM)}
