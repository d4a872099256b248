"""Bundled datasets, the dataset factory and step-addressed batching."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from fusion.data import batch_for_step, build_dataset
from fusion.data.images import CIFAR10_RECORD_BYTES, Cifar10Binary, GeneratedShapes
from fusion.data.text import PySourceText
from fusion.errors import ConfigError
from fusion.losses import cross_entropy
from fusion.models import build_model

_module_counter = itertools.count()


class _IndexDataset:
    """Sample i is (tensor([i]), i): batches show exactly which indices they hold."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([idx]), idx


def test_pysource_samples_shift_by_one() -> None:
    dataset = build_dataset("pysource", seq_len=32, max_bytes=100_000)
    assert isinstance(dataset, PySourceText)
    assert len(dataset) == (100_000 - 1) // 32
    x, y = dataset[5]
    assert x.shape == y.shape == (32,)
    assert x.dtype == y.dtype == torch.int64
    assert 0 <= int(x.min()) and int(x.max()) < 256
    torch.testing.assert_close(x[1:], y[:-1])
    next_x, _ = dataset[6]
    assert int(y[-1]) == int(next_x[0])
    # The corpus is Python source, so it is mostly printable ASCII.
    text = bytes(dataset.corpus[:10_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_pysource_corpus_is_cached() -> None:
    first = PySourceText(seq_len=16, max_bytes=50_000)
    second = PySourceText(seq_len=64, max_bytes=50_000)
    assert first.corpus is second.corpus


def test_pysource_reads_a_local_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(200)))
    dataset = build_dataset("pysource", seq_len=10, path=str(path))
    assert len(dataset) == 19
    x, y = dataset[2]
    assert x.tolist() == list(range(20, 30))
    assert y.tolist() == list(range(21, 31))
    with pytest.raises(ConfigError, match="fewer than"):
        build_dataset("pysource", seq_len=500, path=str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        build_dataset("pysource", path=str(tmp_path / "missing.txt"))


def test_shapes_are_deterministic() -> None:
    first = build_dataset("shapes", seed=3, num_samples=64, image_size=16, num_classes=4)
    second = build_dataset("shapes", seed=3, num_samples=64, image_size=16, num_classes=4)
    other = build_dataset("shapes", seed=4, num_samples=64, image_size=16, num_classes=4)
    x, y = first[7]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= int(y) < 4
    for idx in (0, 7, 63):
        torch.testing.assert_close(first[idx], second[idx])
    assert not torch.equal(first[7][0], other[7][0])
    # Out of order access gives the same sample: generation is per index.
    torch.testing.assert_close(second[63], first[63])


def test_tiny_resnet_learns_shapes() -> None:
    torch.manual_seed(0)
    num_classes = 4
    full = GeneratedShapes(num_samples=1280, image_size=16, num_classes=num_classes, seed=0)
    train, held_out = Subset(full, range(1024)), Subset(full, range(1024, 1280))
    model = build_model("resnet", "tiny", num_classes=num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(100):
        x, y = batch_for_step(train, step, 32, shuffle=True, seed=0)
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    x, y = batch_for_step(held_out, 0, len(held_out), shuffle=False, seed=0)
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy > 0.6, f"held-out accuracy {accuracy:.2f}, chance is {1 / num_classes:.2f}"


def test_batch_for_step_in_order_wraps_into_next_epoch() -> None:
    dataset = _IndexDataset(10)
    x, y = batch_for_step(dataset, 0, 4, shuffle=False, seed=0)
    assert x.shape == (4, 1)
    assert y.dtype == torch.int64
    assert y.tolist() == [0, 1, 2, 3]
    assert batch_for_step(dataset, 1, 4, shuffle=False, seed=0)[1].tolist() == [4, 5, 6, 7]
    assert batch_for_step(dataset, 2, 4, shuffle=False, seed=0)[1].tolist() == [8, 9, 0, 1]
    assert batch_for_step(dataset, 3, 4, shuffle=False, seed=0)[1].tolist() == [2, 3, 4, 5]
    assert batch_for_step(dataset, 0, 10, shuffle=False, seed=0)[1].tolist() == list(range(10))


def test_batch_for_step_shuffle_is_deterministic_per_seed() -> None:
    dataset = _IndexDataset(12)

    def epoch_order(seed: int, first_step: int) -> list[int]:
        steps = range(first_step, first_step + 3)
        return [i for step in steps for i in batch_for_step(dataset, step, 4, shuffle=True, seed=seed)[1].tolist()]

    epoch0 = epoch_order(seed=1, first_step=0)
    assert epoch0 == epoch_order(seed=1, first_step=0)
    assert sorted(epoch0) == list(range(12))  # every sample once per epoch
    assert epoch0 != list(range(12))
    epoch1 = epoch_order(seed=1, first_step=3)
    assert sorted(epoch1) == list(range(12))
    assert epoch1 != epoch0  # a fresh permutation each epoch
    assert epoch_order(seed=2, first_step=0) != epoch0


def test_batch_for_step_shuffle_straddles_epochs() -> None:
    dataset = _IndexDataset(5)
    stream = [i for step in range(5) for i in batch_for_step(dataset, step, 3, shuffle=True, seed=7)[1].tolist()]
    for epoch_idx in range(3):
        assert sorted(stream[epoch_idx * 5 : (epoch_idx + 1) * 5]) == list(range(5))


def test_batch_for_step_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="empty"):
        batch_for_step(_IndexDataset(0), 0, 1, shuffle=False, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        batch_for_step(_IndexDataset(3), 0, 4, shuffle=False, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        batch_for_step(_IndexDataset(3), 0, 0, shuffle=True, seed=0)


def _write_cifar_batch(path: Path, labels: list[int]) -> torch.Tensor:
    images = torch.randint(0, 256, (len(labels), 3, 32, 32), dtype=torch.uint8)
    records = torch.cat([torch.tensor(labels, dtype=torch.uint8)[:, None], images.reshape(len(labels), -1)], dim=1)
    path.write_bytes(bytes(records.flatten().tolist()))
    return images


def test_cifar10_reader_on_synthetic_files(tmp_path: Path) -> None:
    directory = tmp_path / "cifar-10-batches-bin"
    directory.mkdir()
    train_images = [_write_cifar_batch(directory / f"data_batch_{i}.bin", [i, 9 - i]) for i in range(1, 6)]
    _write_cifar_batch(directory / "test_batch.bin", [3, 1, 4])

    train = build_dataset("cifar10", path=str(tmp_path))  # the archive's parent also works
    assert isinstance(train, Cifar10Binary)
    assert len(train) == 10
    x, y = train[2]  # first record of data_batch_2
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and int(y) == 2
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    torch.testing.assert_close(x * std + mean, train_images[1][0].float() / 255)

    test = Cifar10Binary(str(directory), train=False)
    assert [int(test[i][1]) for i in range(len(test))] == [3, 1, 4]
    _, labels = batch_for_step(test, 0, 3, shuffle=False, seed=0)
    assert labels.tolist() == [3, 1, 4]


def test_cifar10_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        build_dataset("cifar10", path=str(tmp_path / "nowhere"))
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * (CIFAR10_RECORD_BYTES + 5))
    with pytest.raises(ConfigError, match="multiple"):
        Cifar10Binary(str(tmp_path), train=False)
    with pytest.raises(ConfigError, match="data_batch_1.bin"):
        Cifar10Binary(str(tmp_path), train=True)


def test_build_dataset_names_and_factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="'mnist'"):
        build_dataset("mnist")
    with pytest.raises(ConfigError, match="colours"):
        build_dataset("shapes", colours=3)

    monkeypatch.syspath_prepend(str(tmp_path))
    module_name = f"fusion_test_user_data_{next(_module_counter)}"
    (tmp_path / f"{module_name}.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch.utils.data import TensorDataset

            def make(num_samples=4):
                return TensorDataset(torch.zeros(num_samples, 2), torch.arange(num_samples))

            def not_a_dataset():
                return 3
            """
        )
    )
    try:
        dataset = build_dataset(f"{module_name}:make", num_samples=6)
        assert isinstance(dataset, TensorDataset) and len(dataset) == 6
        x, y = batch_for_step(dataset, 1, 4, shuffle=False, seed=0)
        assert x.shape == (4, 2) and y.tolist() == [4, 5, 0, 1]
        with pytest.raises(ConfigError, match="__len__"):
            build_dataset(f"{module_name}:not_a_dataset")
    finally:
        sys.modules.pop(module_name, None)
