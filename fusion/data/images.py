"""Image classification data: a generated set for tests and demos, and a CIFAR-10 reader.

:class:`GeneratedShapes` needs no files and is learnable by a small ResNet in a few hundred
steps, so end-to-end tests can check that loss falls. :class:`Cifar10Binary` reads the
"binary version" of CIFAR-10 (https://www.cs.toronto.edu/~kriz/cifar.html) from a local
directory; fusion never downloads data.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Cifar10Binary", "GeneratedShapes"]

_PATTERN_GRID = 4
"""Each class pattern is a random (3, 4, 4) grid upsampled to the image size: low frequency,
so it survives the random shift and is visible through the noise."""


class GeneratedShapes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Generated image classification: one fixed smooth colour pattern per class.

    Sample ``i`` is the pattern of a random class, cyclically shifted by up to a quarter of
    the image in each direction, plus Gaussian noise. Everything is determined by ``seed``
    and ``i``: class patterns, labels and shifts are drawn once at construction, and the
    noise of sample ``i`` comes from its own generator, so samples are built lazily and
    any worker can produce any sample.

    Args:
        num_samples: number of samples.
        image_size: side of the square images in pixels.
        num_classes: number of classes.
        seed: seed of every random choice.
        noise: standard deviation of the additive Gaussian noise (patterns have std ~1).

    Raises:
        ConfigError: a size is not positive or ``noise`` is negative.
    """

    def __init__(
        self,
        num_samples: int = 2048,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        noise: float = 0.3,
    ) -> None:
        for name, value in (("num_samples", num_samples), ("image_size", image_size), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"shapes {name} must be a positive integer, got {value!r}")
        if not noise >= 0.0:
            raise ConfigError(f"shapes noise must be >= 0, got {noise!r}")
        self.num_samples = num_samples
        self.image_size = image_size
        self.num_classes = num_classes
        self.noise = float(noise)

        generator = torch.Generator().manual_seed(seed)
        grid = torch.randn(num_classes, 3, _PATTERN_GRID, _PATTERN_GRID, generator=generator)
        patterns = F.interpolate(grid, size=(image_size, image_size), mode="bilinear", align_corners=False)
        # Unit std per pattern, so `noise` reads as a noise-to-signal ratio.
        std = patterns.flatten(1).std(dim=1).clamp_min(1e-6)  # (K,)
        self.patterns = patterns / std[:, None, None, None]  # (K, 3, H, W)
        self.labels = torch.randint(num_classes, (num_samples,), generator=generator)  # (N,)
        max_shift = image_size // 4
        self.shifts = torch.randint(-max_shift, max_shift + 1, (num_samples, 2), generator=generator)  # (N, 2)
        self.noise_seeds = torch.randint(2**31 - 1, (num_samples,), generator=generator)  # (N,)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample index {idx} out of range for {self.num_samples} samples")
        label = self.labels[idx]
        shift_y, shift_x = (int(s) for s in self.shifts[idx])
        image = torch.roll(self.patterns[label], shifts=(shift_y, shift_x), dims=(1, 2))  # (3, H, W)
        generator = torch.Generator().manual_seed(int(self.noise_seeds[idx]))
        image = image + self.noise * torch.randn(image.shape, generator=generator)  # (3, H, W)
        return image, label.clone()


CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32
"""One label byte, then a 32x32 image as 1024 red, 1024 green, 1024 blue bytes (CHW)."""

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images, pixel values scaled to [0, 1]."""

CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images, scaled to [0, 1]."""

_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_TEST_FILES = ("test_batch.bin",)
_ARCHIVE_DIR = "cifar-10-batches-bin"


class Cifar10Binary(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """CIFAR-10 from the binary files in a local directory.

    ``path`` is the directory holding ``data_batch_1.bin`` .. ``data_batch_5.bin`` and
    ``test_batch.bin``, or the directory the archive was extracted into (which holds
    ``cifar-10-batches-bin/``). All records are loaded into memory (150 MB for the
    training split). Samples are float32 (3, 32, 32) normalised per channel with
    :data:`CIFAR10_MEAN` and :data:`CIFAR10_STD`, and int64 labels.

    Args:
        path: the data directory.
        train: the five training batches if true, else the test batch.

    Raises:
        ConfigError: a file is missing or unreadable, or its size is not a whole number of
            records.
    """

    def __init__(self, path: str, train: bool = True) -> None:
        directory = Path(path)
        if (directory / _ARCHIVE_DIR).is_dir():
            directory = directory / _ARCHIVE_DIR
        names = _TRAIN_FILES if train else _TEST_FILES
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise ConfigError(
                f"CIFAR-10 files {missing} not found in {str(directory)!r}; point path at the "
                f"directory of the binary version (it holds {list(_TRAIN_FILES + _TEST_FILES)})"
            )
        chunks: list[bytes] = []
        for name in names:
            try:
                data = (directory / name).read_bytes()
            except OSError as e:
                raise ConfigError(f"cannot read CIFAR-10 file {str(directory / name)!r}: {e}") from e
            if len(data) == 0 or len(data) % CIFAR10_RECORD_BYTES != 0:
                raise ConfigError(
                    f"CIFAR-10 file {str(directory / name)!r} has {len(data)} bytes, not a positive multiple "
                    f"of the {CIFAR10_RECORD_BYTES}-byte record; it is truncated or not the binary version"
                )
            chunks.append(data)
        records = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        records = records.view(-1, CIFAR10_RECORD_BYTES)  # (N, 3073)
        self.labels = records[:, 0].long()  # (N,)
        if int(self.labels.max()) >= 10:
            raise ConfigError(
                f"CIFAR-10 files in {str(directory)!r} hold label {int(self.labels.max())}, outside 0..9; "
                "they are not the CIFAR-10 binary version (CIFAR-100 has a different layout)"
            )
        self.images = records[:, 1:].view(-1, 3, 32, 32)  # (N, 3, 32, 32) uint8
        self._mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
        self._std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
        logger.info("loaded %d CIFAR-10 %s images from %s", len(self), "train" if train else "test", directory)

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample index {idx} out of range for {len(self)} samples")
        image = (self.images[idx].float() / 255.0 - self._mean) / self._std  # (3, 32, 32)
        return image, self.labels[idx].clone()
