"""Multi-layer perceptron classifier.

Each hidden layer is Linear -> GELU -> Dropout; a linear head gives the class logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 784
    hidden: tuple[int, ...] = (1024, 1024)
    num_classes: int = 10
    dropout: float = 0.0
    bias: bool = True


presets: dict[str, MLPConfig] = {
    "mlp-tiny": MLPConfig(in_features=32, hidden=(64, 64), num_classes=10, dropout=0.1),
    "mlp-small": MLPConfig(in_features=784, hidden=(1024, 1024, 1024), num_classes=10, dropout=0.1),
}


class HiddenLayer(nn.Sequential):
    """Linear -> GELU -> Dropout: the repeated block (what per-block checkpointing wraps)."""

    def __init__(self, c_in: int, c_out: int, bias: bool, dropout: float):
        super().__init__(nn.Linear(c_in, c_out, bias=bias), nn.GELU(), nn.Dropout(dropout))


class MLP(nn.Module):
    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        layers = []
        c = config.in_features
        for width in config.hidden:
            layers.append(HiddenLayer(c, width, config.bias, config.dropout))
            c = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, config.num_classes, bias=config.bias)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.layers(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def example_inputs(config: MLPConfig, batch_size: int, generator: torch.Generator) -> tuple:
    x = torch.randn(batch_size, config.in_features, generator=generator)
    targets = torch.randint(config.num_classes, (batch_size,), generator=generator)
    return x, targets
