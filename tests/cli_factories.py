"""Model factories for the CLI tests (``quantkit quantize tests.cli_factories:mlp ...``)."""

import torch

from tests.models import MLP

__all__ = ["mlp", "data_dependent", "not_a_module", "exp_head", "ansi_error"]


def mlp() -> torch.nn.Module:
    return MLP(d_in=64, d_hidden=128, d_out=32)


class _DataDependent(torch.nn.Module):
    """Branches on a tensor value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 32)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def data_dependent() -> torch.nn.Module:
    return _DataDependent()


def not_a_module():
    return "not a module"


class _ExpHead(torch.nn.Module):
    """An MLP whose output goes through exp: finite on ordinary inputs, inf on large ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(d_in=64, d_hidden=128, d_out=32)

    def forward(self, x):
        return torch.exp(self.body(x))


def exp_head() -> torch.nn.Module:
    return _ExpHead()


def ansi_error() -> torch.nn.Module:
    raise ValueError("\x1b[31mboom\x1b[0m in the factory")
