"""ResNet with BasicBlocks and BatchNorm, as in He et al. (2015).

The "cifar" stem is one 3x3 conv for small images; the "imagenet" stem is 7x7/2 + max-pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ResNetConfig:
    in_channels: int = 3
    num_classes: int = 1000
    widths: tuple[int, ...] = (64, 128, 256, 512)
    depths: tuple[int, ...] = (2, 2, 2, 2)
    stem: str = "imagenet"
    image_size: int = 224

    def __post_init__(self):
        if len(self.widths) != len(self.depths):
            raise ValueError(f"widths {self.widths} and depths {self.depths} differ in length")
        if self.stem not in ("cifar", "imagenet"):
            raise ValueError(f"stem must be 'cifar' or 'imagenet', not {self.stem!r}")


presets: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig(
        num_classes=10, widths=(16, 32, 64), depths=(1, 1, 1), stem="cifar", image_size=32
    ),
    "resnet18": ResNetConfig(),
}


def conv_bn(c_in: int, c_out: int, kernel_size: int, stride: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(c_in, c_out, 3, stride)
        self.conv2 = conv_bn(c_out, c_out, 3)
        needs_projection = stride != 1 or c_in != c_out
        self.shortcut = conv_bn(c_in, c_out, 1, stride) if needs_projection else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.relu(self.conv1(x)))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        c = config.widths[0]
        if config.stem == "imagenet":
            self.stem = nn.Sequential(conv_bn(config.in_channels, c, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(conv_bn(config.in_channels, c, 3), nn.ReLU())
        stages = []
        for i, (width, depth) in enumerate(zip(config.widths, config.depths)):
            first = BasicBlock(c, width, stride=1 if i == 0 else 2)
            rest = [BasicBlock(width, width, stride=1) for _ in range(depth - 1)]
            stages.append(nn.Sequential(first, *rest))
            c = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c, config.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.stages(self.stem(x))
        logits = self.fc(h.mean(dim=(2, 3)))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def example_inputs(config: ResNetConfig, batch_size: int, generator: torch.Generator) -> tuple:
    shape = (batch_size, config.in_channels, config.image_size, config.image_size)
    x = torch.randn(shape, generator=generator)
    targets = torch.randint(config.num_classes, (batch_size,), generator=generator)
    return x, targets
