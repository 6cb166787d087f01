"""Data-parallel ResNet-50 training with collective_ops.

Launch with torchrun on any number of devices::

    torchrun --nproc-per-node 2 examples/train_resnet.py --steps 20 --image-size 32

or with the seed's bash loop (one process per device)::

    for i in 0 1; do RANK=$i WORLD_SIZE=2 DEVICE_ID=$i python examples/train_resnet.py & done; wait

``--optimizer distributed`` (or ``sharded``) trains with ``co.DistributedOptimizer`` (with
``shard=True``), and ``--bucket-size-mb auto`` lets the library choose the bucket size.

The backend follows the hardware: HCCL on Ascend NPUs, NCCL on CUDA GPUs, Gloo on
CPUs (``COLLECTIVE_OPS_BACKEND`` overrides). Data is synthetic unless you bring a loader.
ResNet-50 comes from torchvision where installed, else from the plain-torch definition below
(the script says which it uses).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import collective_ops as co


# -- a plain-torch ResNet-50 (torchvision's layout: same parameter names and shapes) ----------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 where it imports, else the definition above (same names and shapes), said aloud."""
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=num_classes)
    except Exception as exc:  # not installed, or built for another torch
        if co.get_rank() == 0:
            print(
                f"torchvision unavailable ({type(exc).__name__}: {exc}); using this example's own ResNet-50 "
                "(torchvision's layout, its own initialisation). pip install torchvision for the original.",
                flush=True,
            )
        return ResNet((3, 4, 6, 3), num_classes)


def _bucket_size(text: str) -> float | str:
    return text if text == "auto" else float(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--bucket-size-mb", type=_bucket_size, default=25.0, help='MiB, or "auto"')
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--pool", type=int, default=4, help="synthetic batches per rank, cycled (so the loss falls)")
    parser.add_argument("--backend", default=None, help="hccl, nccl or gloo (default: what the hardware offers)")
    parser.add_argument("--compression", choices=["fp16", "bf16"], default=None)
    parser.add_argument(
        "--optimizer",
        choices=["sgd", "distributed", "sharded"],
        default="sgd",
        help="torch SGD after backward; co.DistributedOptimizer (updates overlapped with the next forward); "
        "the same with shard=True (each rank keeps 1/N of the momentum)",
    )
    args = parser.parse_args(argv)

    ctx = co.init(args.backend)
    torch.manual_seed(0)
    device = torch.device(ctx.device)
    model = co.wrap(
        resnet50(args.num_classes).to(device), bucket_size_mb=args.bucket_size_mb, compression=args.compression
    )
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        optimizer = co.DistributedOptimizer(
            model, torch.optim.SGD, lr=args.lr, momentum=0.9, shard=args.optimizer == "sharded"
        )
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1234 + ctx.rank)  # each rank sees its own shard of data

    if ctx.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"ResNet-50: {params / 1e6:.1f} M parameters, {ctx.world_size} rank(s), backend {ctx.backend}, device {device}"
        )
        print(model.describe_plan())

    try:
        from tqdm import tqdm

        steps = tqdm(range(args.steps), disable=ctx.rank != 0, desc="train", unit="step")
    except ImportError:
        steps = range(args.steps)
    pool = [
        (
            torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device),
            torch.randint(0, args.num_classes, (args.batch_size,), generator=generator).to(device),
        )
        for _ in range(args.pool)
    ]
    times = []
    for step in steps:
        images, labels = pool[step % len(pool)]
        start = time.perf_counter()
        loss = loss_fn(model(images), labels)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged across ranks (a DistributedOptimizer: launched) when this returns
        optimizer.step()  # a DistributedOptimizer may return before every bucket is reduced and applied
        times.append(time.perf_counter() - start)
        if ctx.rank == 0 and hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss.item():.3f}", step_s=f"{times[-1]:.2f}")

    if args.optimizer != "sgd":
        optimizer.synchronize()  # the last step's updates, before anything reads the weights
    stats = model.comm_stats()
    if ctx.rank == 0:
        median = statistics.median(times[1:] or times)
        images_per_s = args.batch_size * ctx.world_size / median
        print(
            f"final loss {loss.item():.4f} | median step {median * 1000:.0f} ms | {images_per_s:.1f} images/s in total | "
            f"{stats['buckets']} buckets, {stats['collectives_per_step']} collectives/step "
            f"({stats['bytes_per_step'] / 2**20:.1f} MiB), exposed communication {stats['exposed_comm_s'] * 1000:.1f} ms/step"
        )
    co.barrier()
    co.shutdown()


if __name__ == "__main__":
    main()
