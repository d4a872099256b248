"""Float32 on GPUs means IEEE float32 in fusion, so a split run matches one process.

PyTorch lets cuDNN convolutions (and, when asked, cuBLAS matmuls) round float32 inputs to
TF32, a 10-bit mantissa. The results then depend on how the batch is grouped, and a
pipeline runs micro-batches where the single-process reference runs the whole batch: the
two drift apart by ~1e-3, far beyond the parity bound. Every process that computes a
stage, and the reference, calls :func:`use_exact_fp32` for its CUDA device.
"""

from __future__ import annotations

import torch


def use_exact_fp32(device: torch.device | str) -> None:
    """Turn TF32 off for convolutions and matmuls when ``device`` is a CUDA device (process-wide)."""
    if torch.device(device).type != "cuda":
        return
    # The allow_tf32 flags, not PyTorch 2.9's fp32_precision: every supported version has
    # them, and once the newer API is used reading the older flags raises.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
