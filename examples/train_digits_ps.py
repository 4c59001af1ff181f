"""Train on scikit-learn's digits set through a parameter server.

    totalrun -np 5 python examples/train_digits_ps.py --servers 2 --max-delay 0
    totalrun -np 5 --servers 2 python examples/train_digits_ps.py --max-delay 4 --straggler

The last --servers ranks hold the weights and apply the workers' gradients; the others
train, each on its own shard: pull the weights, push a gradient, end the iteration with
``ps.clock()``.  --max-delay bounds how many iterations a worker may run ahead of the
slowest (0: synchronous SGD; none: never wait).  The model's parameters travel as one
key, so one push and one pull per step.  Worker 0 prints the test accuracy.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import totalreduce as tr
import totalreduce.ps as ps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=None,
                   help="servers among the ranks (default: totalrun --servers, or 1)")
    p.add_argument("--max-delay", default="0",
                   help="iterations a worker may run ahead of the slowest, or 'none'")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.5,
                   help="per iteration of all workers (each push applies 1/workers)")
    p.add_argument("--updater", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--compression", choices=["none", "fp16", "topk"], default="none")
    p.add_argument("--density", type=float, default=0.01, help="with --compression topk")
    p.add_argument("--straggler", action="store_true",
                   help="the last worker runs at half speed (sleeps in each step as long "
                   "as its previous step took)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float | None:
    """Train; worker 0 returns the final test accuracy (servers never return)."""
    args = parse_args(argv)
    if args.servers is not None:
        tr.init(servers=args.servers)
    elif "TOTALREDUCE_SERVERS" not in os.environ:
        tr.init(servers=1)
    delay = None if args.max_delay.lower() == "none" else int(args.max_delay)
    ps.start(updater=args.updater, lr=args.lr, max_delay=delay)
    me, workers = ps.worker_rank(), ps.num_workers()
    # Here, not at the top: servers never come back from ps.start() and need neither
    # (numpy applies the updates), and the imports take 4-6 s of CPU a process.
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    from train_digits import model  # the same MLP as the allreduce example (this folder)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=args.seed, stratify=digits.target)
    shard_x = torch.from_numpy(x_train[me::workers])
    shard_y = torch.from_numpy(y_train[me::workers])
    steps = len(x_train[workers - 1::workers]) // args.batch_size  # the shortest shard's

    net = model()
    params = list(net.parameters())
    vector_to_parameters(torch.from_numpy(
        ps.init("params", parameters_to_vector(params).detach().numpy())), params)
    compression = {"none": None, "fp16": "fp16",
                   "topk": ps.TopK(args.density)}[args.compression]
    generator = torch.Generator().manual_seed(args.seed + me)
    orders = [torch.randperm(len(shard_x), generator=generator) for _ in range(args.epochs)]
    start, lead, last_step = time.perf_counter(), 0, 0.0
    # A killed worker's replacement (totalrun --max-restarts) goes on where it stopped.
    for it in range(ps.iterations_done(), args.epochs * steps):
        epoch, step = divmod(it, steps)
        began = time.perf_counter()
        batch = orders[epoch][step * args.batch_size:(step + 1) * args.batch_size]
        net.zero_grad()
        F.cross_entropy(net(shard_x[batch]), shard_y[batch]).backward()
        grad = parameters_to_vector([p.grad for p in params]).numpy()
        if args.straggler and me == workers - 1:
            time.sleep(last_step)
            began += last_step
        ps.push("params", grad, compression=compression)
        lead = max(lead, it + 1 - ps.clock())
        vector_to_parameters(torch.from_numpy(ps.pull("params")), params)
        last_step = time.perf_counter() - began
    elapsed = time.perf_counter() - start
    try:  # the job trains as fast as its slowest worker
        elapsed = float(tr.allreduce(np.array([elapsed]), op=tr.Max,
                                     process_set=ps.workers())[0])
    except ValueError:  # no process sets with --max-restarts: worker 0's own time
        pass
    ps.finish()
    if me != 0:
        return None
    with torch.no_grad():
        predicted = net(torch.from_numpy(x_test)).argmax(1).numpy()
    accuracy = float((predicted == y_test).mean())
    samples = args.epochs * steps * args.batch_size * workers
    print(f"training took {elapsed:.2f} s: {samples / elapsed:,.0f} samples/s")
    print(f"{workers} workers, {tr.size() - workers} servers, max delay {args.max_delay}: "
          f"test accuracy {accuracy:.2%} after {args.epochs} epochs; worker 0 ran at most "
          f"{lead} iterations ahead of the slowest", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
