"""QAT on scikit-learn's digits: float, PTQ and QAT accuracy of a small conv-BN CNN at low bit widths.

    python benchmarks/bench_qat.py     # PTQ at W8A8 W4A8 W4A4 W3A8 W2A8, QAT at W8A8 and W2A8

Held-out split: 25% of the 1,797 digits (stratified, seed 0). The float CNN trains 8 epochs (Adam);
PTQ calibrates on 256 training images (minmax activations, per-channel minmax weights); QAT starts
from the float weights and fine-tunes 4 epochs with fake quantization and learnable ranges (LSQ/LSQ+;
Adam 1e-3, cosine decay), observers frozen after the first epoch, and is then converted to the int8
artifact, which is what is evaluated.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import quantkit
from quantkit.quantizers import QuantConfig, W8A8Quantizer

__all__ = ["DigitsCNN", "load_digits_split", "train_float", "accuracy", "run_qat"]


class DigitsCNN(nn.Module):
    """Two conv → BN → relu blocks, max pooling, a linear head (8x8 inputs)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(2 * c * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        return self.head(torch.flatten(x, 1))


def load_digits_split(seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: digits scaled to [0, 1], ``[N, 1, 8, 8]``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=0.25, random_state=seed, stratify=data.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def _batches(x, y, size, gen):
    order = torch.randperm(len(y), generator=gen)
    for i in range(0, len(y), size):
        j = order[i:i + size]
        yield x[j], y[j]


def train_float(x, y, epochs: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for xb, yb in _batches(x, y, 64, gen):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model, x, y) -> float:
    """Top-1 accuracy in percent."""
    return 100.0 * float((model(x).argmax(1) == y).float().mean())


def run_qat(gm, x, y, config: QuantConfig, epochs: int = 4, lr: float = 1e-3, seed: int = 0, on_epoch=None):
    """QAT from the captured float model (Adam, learning rate decayed to 0 along a cosine); returns
    the converted int8 model. ``on_epoch(epoch, qat)`` is called after each epoch with the QAT model
    in eval mode."""
    torch.manual_seed(seed)
    steps_per_epoch = (len(y) + 63) // 64
    qat = quantkit.prepare_qat(gm, W8A8Quantizer(config), freeze_observers_after=steps_per_epoch)
    opt = torch.optim.Adam(qat.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        qat.train()
        for xb, yb in _batches(x, y, 64, gen):
            opt.zero_grad()
            nn.functional.cross_entropy(qat(xb), yb).backward()
            opt.step()
            sched.step()
        qat.eval()
        if on_epoch is not None:
            on_epoch(epoch + 1, qat)
    return quantkit.convert(qat)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", nargs="+", default=["8x8", "4x8", "4x4", "3x8", "2x8"], help="PTQ at these WxA widths")
    ap.add_argument("--qat-bits", nargs="+", default=["8x8", "2x8"], help="QAT at these WxA widths")
    ap.add_argument("--epochs", type=int, default=4, help="QAT epochs")
    args = ap.parse_args(argv)
    x_train, y_train, x_test, y_test = load_digits_split()
    start = time.perf_counter()
    model = train_float(x_train, y_train)
    float_acc = accuracy(model, x_test, y_test)
    gm = quantkit.capture(model, (x_train[:8],))
    calib = [(b,) for b in x_train[:256].split(64)]
    print(f"float CNN: {float_acc:.2f}% on {len(y_test)} held-out digits (trained in {time.perf_counter() - start:.0f} s)",
          flush=True)
    print(f"{'bits':<6} {'float':>7} {'PTQ':>7} {'QAT':>7} {'PTQ loss':>9} {'recovered':>10}")
    for spec in list(dict.fromkeys(args.bits + args.qat_bits)):
        w, a = (int(v) for v in spec.lower().split("x"))
        config = QuantConfig(weight_bits=w, activation_bits=a)
        ptq = quantkit.quantize(gm, None, calib, W8A8Quantizer(config), progress=False)
        ptq_acc = accuracy(ptq, x_test, y_test)
        lost = float_acc - ptq_acc
        qat_acc, recovered = float("nan"), "-"
        if spec in args.qat_bits:
            t = time.perf_counter()
            config = QuantConfig(weight_bits=w, activation_bits=a, learnable_ranges=True)
            qat_acc = accuracy(run_qat(gm, x_train, y_train, config, epochs=args.epochs), x_test, y_test)
            recovered = f"{100 * (qat_acc - ptq_acc) / lost:.0f}%" if lost > 0 else "-"
            recovered += f" ({time.perf_counter() - t:.0f} s)"
        print(f"W{w}A{a:<4} {float_acc:7.2f} {ptq_acc:7.2f} {qat_acc:7.2f} {lost:9.2f} {recovered:>10}", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
