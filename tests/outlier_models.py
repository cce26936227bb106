"""Float models with planted activation outliers, for the accuracy-tool tests and benchmarks."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PlantedOutlierMLP", "ChannelOutlierBlock", "make_planted", "make_channel_outliers"]


class PlantedOutlierMLP(nn.Module):
    """fc1 → fc2 → fc3 → fc4 with ReLUs; two channels of fc2's output are 1000× larger
    (and fc3's weights for them 1000× smaller, so the function is unchanged): only fc3
    sees the outliers, and a per-tensor int8 scale for its input wipes out the rest."""

    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 32, factor: float = 1000.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc4 = nn.Linear(hidden, d_out)
        with torch.no_grad():
            self.fc2.weight[:2] *= factor
            self.fc2.bias[:2] = factor * self.fc2.bias[:2].abs()
            self.fc3.weight[:, :2] /= factor

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        return self.fc4(x)


class ChannelOutlierBlock(nn.Module):
    """LayerNorm → fc1 → ReLU → fc2, with four LayerNorm channels at gain 50: the
    channel outliers of LLM activations, in miniature."""

    def __init__(self, d: int = 64, gain: float = 50.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        with torch.no_grad():
            self.ln.weight[:4] = gain

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


def make_planted(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return PlantedOutlierMLP().eval(), torch.randn(512, 64)


def make_channel_outliers(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return ChannelOutlierBlock().eval(), torch.randn(256, 16, 64)
