"""Training throughput on random data: images/s per worker and in total.

    totalrun -np 2 python examples/torch_synthetic_benchmark.py --model resnet-ish

Modelled on the synthetic benchmark Horovod ships: a model, a fixed random batch, warm-up
iterations, then timed rounds of iterations, each round reporting images/s.  No data set
and no torchvision needed: the models are defined here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import totalreduce.torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["resnet-ish", "mlp"], default="resnet-ish")
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-warmup-batches", type=int, default=3)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    return p.parse_args()


class Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.skip = None if stride == 1 and cin == cout else torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.skip is None else self.skip(x)))


def resnet_ish(classes: int = 1000) -> torch.nn.Module:
    """A ResNet-18-shaped network (11.7 M parameters at 1000 classes)."""
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(512, classes)]
    return torch.nn.Sequential(*layers)


def mlp(size: int, classes: int = 1000) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * size * size, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, classes))


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    model = resnet_ish() if args.model == "resnet-ish" else mlp(args.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"model {args.model} ({params / 1e6:.1f} M parameters), batch {args.batch_size} per "
        f"worker, {args.image_size}x{args.image_size} images, {hvd.size()} worker(s), "
        f"{args.threads} thread(s) each")
    for _ in range(args.num_warmup_batches):
        benchmark_step()
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            benchmark_step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
        log(f"iter #{i}: {rate:.1f} img/s per worker")
        rates.append(rate)
    mean = statistics.fmean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    log(f"img/s per worker: {mean:.1f} +- {spread:.1f}")
    log(f"total img/s on {hvd.size()} worker(s): {hvd.size() * mean:.1f} "
        f"+- {hvd.size() * spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
