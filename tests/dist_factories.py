"""Model factories for the distributed CLI tests (``quantkit quantize tests.dist_factories:sqrt_mlp ...``)."""

import torch

__all__ = ["sqrt_mlp"]


class _SqrtMLP(torch.nn.Module):
    """A linear layer after sqrt: a sample with a negative value puts NaN into an observed activation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.sqrt(x))))


def sqrt_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return _SqrtMLP()
