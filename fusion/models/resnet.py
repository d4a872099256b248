"""ResNet, written from scratch with torchvision's module layout.

He et al., 2016, "Deep Residual Learning for Image Recognition": BasicBlock (two 3x3
convolutions) for depths 18 and 34, Bottleneck (1x1, 3x3, 1x1 with 4x expansion) for 50, 101
and 152. Stride sits on the 3x3 convolution of a Bottleneck ("ResNet v1.5", as torchvision).
With ``width=64``, ``num_classes=1000`` and ``image_size=224`` the parameter count equals
torchvision's model of the same depth.

Images of at most 64 pixels get a CIFAR-style stem (He et al., 2016, sec 4.2): one 3x3
stride-1 convolution and no max-pool, so a 32x32 input is not reduced to 8x8 before the
first stage. ``forward`` never branches on tensors, so it traces with
:func:`torch.fx.symbolic_trace`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.nn import functional as F

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "PRESET_ALIASES", "BasicBlock", "Bottleneck", "ResNet", "ResNetConfig"]

STAGE_BLOCKS: dict[int, tuple[int, int, int, int]] = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
"""Blocks per stage for each standard depth (He et al., 2016, table 1)."""

SMALL_STEM_MAX_IMAGE_SIZE = 64
"""Largest image side (pixels) that gets the 3x3 stride-1 stem instead of 7x7 + max-pool."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """Shape of a ResNet image classifier."""

    depth: int = 18
    """One of 18, 34, 50, 101, 152; picks the block type (Basic below 50, Bottleneck from 50)."""

    width: int = 64
    """Channels of the stem and of the first stage; each later stage doubles it."""

    num_classes: int = 10
    """Number of output logits."""

    image_size: int = 32
    """Side of the (square) input images in pixels; <= 64 selects the small-image stem."""

    in_channels: int = 3
    """Channels of the input images."""

    stage_blocks: tuple[int, ...] | None = None
    """Blocks in each of the four stages; ``None`` means the standard layout for ``depth``."""

    def __post_init__(self) -> None:
        if self.depth not in STAGE_BLOCKS:
            raise ConfigError(
                f"ResNetConfig.depth={self.depth!r} is not supported; choose one of {sorted(STAGE_BLOCKS)}"
            )
        for name in ("width", "num_classes", "image_size", "in_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ResNetConfig.{name} must be a positive integer, got {value!r}")
        if self.stage_blocks is not None:
            blocks = tuple(self.stage_blocks)
            if len(blocks) != 4 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in blocks):
                raise ConfigError(
                    f"ResNetConfig.stage_blocks must be four positive integers, got {self.stage_blocks!r}"
                )
            # Accept a list from a job file but store a hashable tuple.
            object.__setattr__(self, "stage_blocks", blocks)

    @property
    def blocks_per_stage(self) -> tuple[int, ...]:
        """Blocks in each stage, after applying the ``depth`` default."""
        return self.stage_blocks if self.stage_blocks is not None else STAGE_BLOCKS[self.depth]

    @property
    def small_stem(self) -> bool:
        """Whether the 3x3 stride-1 stem (no max-pool) is used."""
        return self.image_size <= SMALL_STEM_MAX_IMAGE_SIZE


PRESETS: dict[str, dict[str, object]] = {
    **{str(depth): dict(depth=depth) for depth in STAGE_BLOCKS},
    # One BasicBlock per stage, 8 base channels, 16x16 images: for tests.
    "tiny": dict(depth=18, stage_blocks=(1, 1, 1, 1), width=8, image_size=16),
}
"""Named configurations, as keyword arguments of :class:`ResNetConfig`."""

PRESET_ALIASES: dict[str, str] = {f"resnet{depth}": str(depth) for depth in STAGE_BLOCKS}
"""Other accepted preset names, mapped to their key in :data:`PRESETS`."""


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions on a residual branch (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = _conv3x3(in_channels, channels, stride)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H / stride, W / stride)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4 on a residual branch (ResNet-50+)."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = _conv1x1(in_channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = _conv1x1(channels, out_channels)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, 4 * channels, H / stride, W / stride)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a strided 1x1 projection (He et al., 2016, option B)."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(_conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels))


class ResNet(nn.Module):
    """ResNet classifier: images (B, in_channels, H, W) to logits (B, num_classes)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        block: type[BasicBlock | Bottleneck] = BasicBlock if config.depth < 50 else Bottleneck
        if config.small_stem:
            self.conv1 = _conv3x3(config.in_channels, config.width)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(config.in_channels, config.width, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(config.width)

        in_channels = config.width
        stages: list[nn.Sequential] = []
        for stage_idx, num_blocks in enumerate(config.blocks_per_stage):
            channels = config.width * 2**stage_idx
            first_stride = 1 if stage_idx == 0 else 2
            blocks: list[nn.Module] = []
            for block_idx in range(num_blocks):
                blocks.append(block(in_channels, channels, first_stride if block_idx == 0 else 1))
                in_channels = channels * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.num_classes)

        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        logger.debug("built ResNet with %d parameters from %s", self.num_parameters(), config)

    def num_parameters(self) -> int:
        """Number of parameter elements (BatchNorm running statistics are buffers, not counted)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Classify images.

        Args:
            x: float images of shape (B, in_channels, H, W).

        Returns:
            Logits of shape (B, num_classes).
        """
        x = F.relu(self.bn1(self.conv1(x)))  # (B, w, H', W')
        x = self.maxpool(x)  # (B, w, H'', W'')
        x = self.layer1(x)  # (B, w * e, H'', W'')
        x = self.layer2(x)  # (B, 2w * e, H''/2, W''/2)
        x = self.layer3(x)  # (B, 4w * e, H''/4, W''/4)
        x = self.layer4(x)  # (B, 8w * e, H''/8, W''/8)
        x = torch.flatten(self.avgpool(x), 1)  # (B, 8w * e)
        return self.fc(x)  # (B, num_classes)
