"""fusion.devices: CUDA stages compute float32 as IEEE float32 (TF32 off); the CPU is left alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from executor.build import parse_device
from fusion.devices import use_exact_fp32


@pytest.fixture
def tf32_on() -> Iterator[None]:
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.usefixtures("tf32_on")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_turns_tf32_off(device: str | torch.device) -> None:
    use_exact_fp32(device)  # only flags: needs no GPU
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.usefixtures("tf32_on")
def test_cpu_leaves_the_flags() -> None:
    use_exact_fp32("cpu")
    assert torch.backends.cudnn.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: a worker checks CUDA before it takes the device"
)
@pytest.mark.usefixtures("tf32_on")
def test_a_cuda_worker_device_turns_tf32_off() -> None:
    assert parse_device("cuda").type == "cuda"
    assert not torch.backends.cudnn.allow_tf32
