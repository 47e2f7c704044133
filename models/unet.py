"""Diffusion U-Net in the manner of DDPM (Ho et al., 2020): predicts the noise in x at timestep t.

ResBlocks take a sinusoidal timestep embedding; skips are concatenated on the way up;
optional single-head self-attention at chosen resolutions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 3
    image_size: int = 64
    base_channels: int = 64
    channel_mults: tuple[int, ...] = (1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (16,)
    norm_groups: int = 32
    dropout: float = 0.1
    num_timesteps: int = 1000

    def __post_init__(self):
        halvings = len(self.channel_mults) - 1
        if self.image_size % 2**halvings:
            raise ValueError(f"image_size {self.image_size} does not halve {halvings} times")
        if any(self.base_channels * m % self.norm_groups for m in (1, *self.channel_mults)):
            raise ValueError(f"channel widths are not divisible by norm_groups {self.norm_groups}")


presets: dict[str, UNetConfig] = {
    "unet-tiny": UNetConfig(
        image_size=16, base_channels=16, channel_mults=(1, 2), num_res_blocks=1,
        attn_resolutions=(8,), norm_groups=8, dropout=0.1,
    ),
    "unet-small": UNetConfig(),
}


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * half, out_dim), nn.SiLU(), nn.Linear(out_dim, out_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        args = t.float()[:, None] * self.freqs[None, :]
        return self.mlp(torch.cat([args.sin(), args.cos()], dim=1))


class Attention(nn.Module):
    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        self.scale = 1.0 / math.sqrt(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.size(0), x.size(1), x.size(2), x.size(3)
        q, k, v = self.qkv(self.norm(x)).flatten(2).split(C, dim=1)
        att = F.softmax((q.transpose(1, 2) @ k) * self.scale, dim=-1)
        h = (v @ att.transpose(1, 2)).view(B, C, H, W)
        return x + self.proj(h)


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, config: UNetConfig, attend: bool):
        super().__init__()
        self.norm1 = nn.GroupNorm(config.norm_groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(4 * config.base_channels, c_out)
        self.norm2 = nn.GroupNorm(config.norm_groups, c_out)
        self.dropout = nn.Dropout(config.dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        self.attn = Attention(c_out, config.norm_groups) if attend else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(F.silu(emb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.attn(h + self.skip(x))


class Level(nn.Module):
    def __init__(self, blocks: list[ResBlock], resample: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.resample = resample


class UNet(nn.Module):
    def __init__(self, config: UNetConfig):
        super().__init__()
        self.config = config
        base, n = config.base_channels, config.num_res_blocks
        widths = [base * m for m in config.channel_mults]
        last = len(widths) - 1
        self.time_embed = TimestepEmbedding(base, 4 * base)
        self.conv_in = nn.Conv2d(config.in_channels, base, 3, padding=1)

        self.down = nn.ModuleList()
        c = base
        for i, width in enumerate(widths):
            attend = config.image_size // 2**i in config.attn_resolutions
            first = ResBlock(c, width, config, attend)
            rest = [ResBlock(width, width, config, attend) for _ in range(n - 1)]
            downsample = nn.Conv2d(width, width, 3, stride=2, padding=1) if i < last else nn.Identity()
            self.down.append(Level([first, *rest], downsample))
            c = width

        self.mid = nn.ModuleList([ResBlock(c, c, config, True), ResBlock(c, c, config, False)])

        self.up = nn.ModuleList()
        for i, width in reversed(list(enumerate(widths))):
            attend = config.image_size // 2**i in config.attn_resolutions
            upsample = nn.Sequential(nn.Upsample(scale_factor=2.0), nn.Conv2d(c, c, 3, padding=1))
            first = ResBlock(c + width, width, config, attend)
            rest = [ResBlock(width, width, config, attend) for _ in range(n - 1)]
            self.up.append(Level([first, *rest], upsample if i < last else nn.Identity()))
            c = width

        self.norm_out = nn.GroupNorm(config.norm_groups, c)
        self.conv_out = nn.Conv2d(c, config.in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.time_embed(t)
        h = self.conv_in(x)
        skips = []
        for level in self.down:
            for block in level.blocks:
                h = block(h, emb)
            skips.append(h)
            h = level.resample(h)
        for block in self.mid:
            h = block(h, emb)
        for level in self.up:
            h = torch.cat([level.resample(h), skips.pop()], dim=1)
            for block in level.blocks:
                h = block(h, emb)
        noise = self.conv_out(F.silu(self.norm_out(h)))
        if targets is None:
            return noise
        return F.mse_loss(noise, targets)


def example_inputs(config: UNetConfig, batch_size: int, generator: torch.Generator) -> tuple:
    shape = (batch_size, config.in_channels, config.image_size, config.image_size)
    x = torch.randn(shape, generator=generator)
    t = torch.randint(config.num_timesteps, (batch_size,), generator=generator)
    targets = torch.randn(shape, generator=generator)
    return x, t, targets
