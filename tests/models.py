"""Small models for the adapter tests: an MLP, a CNN with BatchNorm, a transformer with tied weights."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def batch(gen: torch.Generator, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),  # a bias before BatchNorm has no gradient
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    @staticmethod
    def batch(gen: torch.Generator, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 12, 12, generator=gen), torch.randint(0, 4, (n,), generator=gen)


class TinyTransformer(nn.Module):
    """Embedding tied to the output projection: one parameter used twice per step."""

    vocab = 50

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 32)
        self.encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, self.vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.encoder(self.embed(tokens)))).flatten(0, 1)

    @staticmethod
    def batch(gen: torch.Generator, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, TinyTransformer.vocab, (n, 6), generator=gen)
        return tokens, torch.roll(tokens, -1, dims=1).flatten()


class WithUnusedBranch(nn.Module):
    """``branch`` is used only when asked: different ranks may use different parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)

    batch = MLP.batch


class Reordered(nn.Module):
    """Modules registered in the opposite order of their use in forward (the initial plan follows registration)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = nn.Linear(32, 4)
        self.middle = nn.Linear(32, 32)
        self.first = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))

    batch = MLP.batch


class ClassicNormsMLP(nn.Module):
    """The MLP with the classic ``torch.nn.utils.weight_norm`` and ``spectral_norm``: each computes its layer's
    weight from parameters in a forward pre-hook of its own (GAN and vocoder code still uses them)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import spectral_norm, weight_norm

        self.net = nn.Sequential(
            weight_norm(nn.Linear(16, 64)),
            nn.ReLU(),
            spectral_norm(nn.Linear(64, 64)),
            nn.ReLU(),
            weight_norm(nn.Linear(64, 4)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    batch = MLP.batch


class ParametrizedNormsMLP(nn.Module):
    """The MLP with the parametrization forms of weight and spectral norm: each layer's weight is computed from
    its parameters whenever the module reads it (``torch.nn.utils.parametrizations``)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import parametrizations

        self.net = nn.Sequential(
            parametrizations.weight_norm(nn.Linear(16, 64)),
            nn.ReLU(),
            parametrizations.spectral_norm(nn.Linear(64, 64)),
            nn.ReLU(),
            nn.Linear(64, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    batch = MLP.batch


class CheckpointedMLP(nn.Module):
    """An MLP whose two middle blocks run under activation checkpointing: their forward (and every forward
    pre-hook on them) runs again inside backward, to recompute what was not kept."""

    reentrant = False

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.block1 = nn.Sequential(nn.ReLU(), nn.Linear(64, 64))
        self.block2 = nn.Sequential(nn.ReLU(), nn.Linear(64, 64))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        # the first layer outside: a reentrant checkpoint needs an input that requires grad
        h = checkpoint(self.block1, self.first(x), use_reentrant=self.reentrant)
        return self.head(checkpoint(self.block2, h, use_reentrant=self.reentrant))

    batch = MLP.batch


class ReentrantCheckpointedMLP(CheckpointedMLP):
    """The same with the reentrant implementation: the recomputation runs a backward of its own."""

    reentrant = True


class CheckpointedHeadMLP(nn.Module):
    """The output layer inside a reentrant checkpoint: the first gradients come from the backward that the
    checkpoint runs inside the outer one, which ends before the outer one reaches the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.rest = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.rest, self.first(x), use_reentrant=True)

    batch = MLP.batch


class ModelOutput(dict):
    """A model output class as transformers' are: a dict subclass (torch's pytree does not look inside it)."""


class CheckpointedHeadDictMLP(CheckpointedHeadMLP):
    """The output layer inside a reentrant checkpoint, its logits returned in a ``ModelOutput``."""

    def forward(self, x: torch.Tensor) -> ModelOutput:
        return ModelOutput(logits=super().forward(x))


class UntiedLM(nn.Module):
    """An embedding of its own (not tied): a batch looks up ~20 of its 200 rows, so its gradient is row-sparse."""

    vocab = 200

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))).mean(1))

    @staticmethod
    def batch(gen: torch.Generator, n: int = 4, low: int = 0, high: int = vocab) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(low, high, (n, 5), generator=gen), torch.randint(0, 10, (n,), generator=gen)


class UnusedTableLM(UntiedLM):
    """UntiedLM whose forward never looks its table up: a row-sparse table with no rows (find_unused_parameters)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(tokens.float().unsqueeze(-1).expand(-1, -1, 16))).mean(1))


class PaddedLM(UntiedLM):
    """UntiedLM whose table has ``padding_idx=0``: row 0 is looked up, yet its gradient is always zero."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 16, padding_idx=0)


class PeekingLM(UntiedLM):
    """UntiedLM that, for a batch starting with its last token, also reads its table's row 0 outside the module:
    a gradient row no lookup recorded (the batches never look row 0 up)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        if int(tokens[0, 0]) == self.vocab - 1:
            out = out + self.embed.weight[0, : out.shape[1]]
        return out


class ScaledMLP(MLP):
    """An MLP whose logits are scaled by a learned 0-d parameter (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.logit_scale


class PeekAheadMLP(nn.Module):
    """Reads its last layer's bias in its own forward before that layer runs (the add keeps nothing for backward,
    so autograd never sees the bias change under it)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.last = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) + self.last.bias.sum()
        return self.last(torch.relu(h))

    batch = MLP.batch


class _Gate(nn.Module):
    """A projection gated by another branch's weight, read through a reference (not a submodule of this one)."""

    def __init__(self, peer: nn.Linear) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self._peer = (peer,)  # (a tuple: not registered, so the peer's parameters are not this module's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (the peer's weight alone fills most of a test bucket: never in one with this module's parameters)
        return torch.relu(self.proj(x)) * torch.sigmoid(self._peer[0].weight.sum(1))


class PeekAcrossMLP(nn.Module):
    """Two top-level branches; the first (``left``) reads a parameter of the second (``right``), which runs later."""

    def __init__(self) -> None:
        super().__init__()
        self.right = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.left = _Gate(self.right[0])
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.left(x), self.right(x)], dim=1))

    batch = MLP.batch


class PeekTiedMLP(nn.Module):
    """``third`` shares ``second``'s weight (tied); the forward reads it through ``third`` before either runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 32)
        self.third = nn.Linear(32, 32)
        self.third.weight = self.second.weight
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x)) * torch.tanh(self.third.weight.mean(0))
        return self.head(torch.relu(self.third(torch.relu(self.second(h)))))

    batch = MLP.batch


MODELS = {
    "mlp": MLP,
    "cnn": SmallCNN,
    "transformer": TinyTransformer,
    "untied-lm": UntiedLM,
    "classic-norms": ClassicNormsMLP,
    "parametrized-norms": ParametrizedNormsMLP,
    "checkpointed": CheckpointedMLP,
    "checkpointed-reentrant": ReentrantCheckpointedMLP,
    "checkpointed-head": CheckpointedHeadMLP,
}
# Built by name too, but not in MODELS (whose every model the adapter tests train on its output tensor)
OTHER_OUTPUTS = {"checkpointed-head-dict": CheckpointedHeadDictMLP, "scaled-mlp": ScaledMLP}
# Forwards that read parameters of modules before those run (built by name, not in MODELS)
PEEKING = {"peek-ahead": PeekAheadMLP, "peek-across": PeekAcrossMLP, "peek-tied": PeekTiedMLP}


def gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(generator, discriminator), small: the generator's loss backpropagates through the discriminator."""
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    discriminator = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return generator, discriminator


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {**MODELS, **OTHER_OUTPUTS, **PEEKING}[name]()


def rank_batch(model_cls: type, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return model_cls.batch(gen)
