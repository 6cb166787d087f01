"""The network, batches and loss the msrun workers share (no side effects on import)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn


class Net(nn.Cell):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="same", has_bias=True)
        self.flat = nn.Flatten()
        self.fc1 = nn.Dense(4 * 6 * 6, width)
        self.branch = nn.Dense(width, width)
        self.fc2 = nn.Dense(width, 3)
        self.relu = nn.ReLU()

    def construct(self, x, use_branch=True):
        h = self.relu(self.fc1(self.flat(self.relu(self.conv(x)))))
        if use_branch:
            h = h + self.branch(h)
        return self.fc2(h)


def build(seed: int = 0) -> Net:
    ms.set_seed(seed)
    return Net()


def batch(step: int, r: int):
    rng = np.random.default_rng(100 * step + r)
    return ms.Tensor(rng.standard_normal((4, 3, 6, 6)).astype(np.float32)), ms.Tensor(
        rng.integers(0, 3, 4).astype(np.int32)
    )


loss_fn = nn.CrossEntropyLoss()
