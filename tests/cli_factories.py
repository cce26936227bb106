"""Model factories for the CLI tests (``quantkit quantize tests.cli_factories:mlp ...``), and the files
and arguments of a ``quantize`` run on :func:`mlp`."""

import torch

from tests.models import MLP

__all__ = ["mlp", "data_dependent", "not_a_module", "exp_head", "ansi_error", "write_mlp_inputs", "mlp_quantize_args"]


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


def write_mlp_inputs(directory, calib_rows: int):
    """``(weights, calib)``: :func:`mlp`'s weights (seed 1) as safetensors, and one calibration file of
    ``calib_rows`` x 64 normal rows (seed 0), under ``directory``."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    weights = directory / "mlp.safetensors"
    save_file(mlp().state_dict(), str(weights))  # 64 -> 128 -> 128 -> 32 linears
    calib = directory / "calib"
    calib.mkdir()
    torch.save(torch.randn(calib_rows, 64, generator=torch.Generator().manual_seed(0)), calib / "b.pt")
    return weights, calib


def mlp_quantize_args(weights, calib, out, *extra) -> list:
    """``quantkit quantize`` arguments for :func:`mlp` with the files of :func:`write_mlp_inputs`."""
    return ["quantize", "tests.cli_factories:mlp", "--weights", str(weights), "--example-input", "8x64:float32",
            "--calib", str(calib), "--out", str(out), "--quiet", *extra]
