"""Is the model of the chaos run the model of the uninterrupted run?

Without compression the contract is exact: every tensor of ``model.safetensors`` equal bit
for bit (``torch.equal``). With compression, recovery may replay a step with different
error-feedback state, so the contract is the final loss within :data:`LOSS_TOLERANCE`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Relative final-loss tolerance with compression (issue 32).
LOSS_TOLERANCE = 0.02


def compare_models(
    model: Path | None,
    reference: Path | None,
    *,
    compressed: bool,
    loss: float | None,
    reference_loss: float | None,
) -> dict[str, Any]:
    """The comparison's findings: ``equal`` (True/False, None when a model is missing) and how."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    out: dict[str, Any] = {"compressed": compressed, "loss": loss, "reference_loss": reference_loss}
    if loss is not None and reference_loss:
        out["loss_diff_pct"] = 100.0 * abs(loss - reference_loss) / abs(reference_loss)
    if model is None or not model.exists() or reference is None or not reference.exists():
        out.update(equal=None, why="a model file is missing (a job did not finish)")
        return out
    a, b = load_file(str(model)), load_file(str(reference))
    if set(a) != set(b):
        out.update(equal=False, why=f"different tensors: {sorted(set(a) ^ set(b))[:5]}")
        return out
    differ = [k for k in sorted(a) if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    max_abs = 0.0
    for k in differ:
        if a[k].shape == b[k].shape:
            max_abs = max(max_abs, float((a[k].float() - b[k].float()).abs().max()))
    out.update(num_tensors=len(a), num_differ=len(differ), differ=differ[:10], max_abs_diff=max_abs)
    if compressed:
        pct = out.get("loss_diff_pct")
        out["equal"] = pct is not None and pct <= 100.0 * LOSS_TOLERANCE
        out["why"] = f"final loss within {100 * LOSS_TOLERANCE:g} %" if out["equal"] else "final loss differs"
    else:
        out["equal"] = not differ
        out["why"] = "bit for bit" if not differ else f"{len(differ)} tensor(s) differ"
    return out
