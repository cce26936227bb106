"""Small float models shared by the tests and the benchmarks."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["MLP", "SmallCNN", "TransformerBlock", "TwoBlockNet", "make_mlp", "make_cnn", "make_transformer"]


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, d_hidden: int = 128, d_out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(x + y)


class _LinearBlock(nn.Module):
    """Pre-norm residual MLP: a chain of these is what GPTQ's block partition finds."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class TwoBlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_LinearBlock(), _LinearBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SmallCNN(nn.Module):
    """conv+bn stem, two residual blocks with max pooling, linear head (8x8 inputs, e.g. digits)."""

    def __init__(self, c: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.block1 = _Block(c)
        self.pool = nn.MaxPool2d(2)
        self.block2 = _Block(c)
        self.head = nn.Linear(c * 4 * 4, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = self.pool(self.block1(x))
        x = self.block2(x)
        return self.head(torch.flatten(x, 1))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block with explicit attention matmuls."""

    def __init__(self, d: int = 64, heads: int = 4, ff: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff * d)
        self.fc2 = nn.Linear(ff * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def _randomize_bn(model: nn.Module, gen: torch.Generator) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x):
        w = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(w))))


class MobileBlock(nn.Module):
    """MobileNetV3-style: conv-BN-hardswish stem, depthwise conv-BN-ReLU6, squeeze-excite,
    pointwise conv-BN, residual add, global pool and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.se = _SqueezeExcite(16)
        self.pw = nn.Sequential(nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.pw(self.se(self.dw(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class CatPoolNet(nn.Module):
    """Two conv branches concatenated, max and average pooling, a transposed conv with BN."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.c = nn.Conv2d(16, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, 2)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        y = nn.functional.max_pool2d(y, 2)
        y = nn.functional.avg_pool2d(torch.relu(self.c(y)), 2)
        return self.fc(torch.relu(self.bn(self.up(y))).flatten(1))


def make_mobile(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    m = _randomize_bn(MobileBlock(), torch.Generator().manual_seed(seed)).eval()
    return m, torch.randn(64, 3, 32, 32)


def make_catpool(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    m = _randomize_bn(CatPoolNet(), torch.Generator().manual_seed(seed)).eval()
    return m, torch.randn(64, 3, 16, 16)


def make_mlp(seed: int = 0, **kw) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    m = MLP(**kw).eval()
    return m, torch.randn(256, m.fc1.in_features)


def make_cnn(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    m = _randomize_bn(SmallCNN(), gen).eval()
    return m, torch.randn(128, 1, 8, 8)


def make_transformer(seed: int = 0, d: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    m = TransformerBlock(d=d).eval()
    return m, torch.randn(32, 16, d)
