"""train_digits.py on a Ray cluster: one Ray actor per rank instead of one process per
rank from totalrun.

    python examples/train_digits_ray.py --workers 2 -- --epochs 20
    python examples/train_digits_ray.py --address auto --workers 8 -- --epochs 20

Arguments after ``--`` go to train_digits.py unchanged.  Without ``--address`` a local
Ray instance is started with ``--workers`` CPUs.  Needs ``pip install 'totalreduce[ray]'``
besides the examples' extras.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

from totalreduce.ray import RayExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def train(argv: list[str]) -> float:
    # Imported on the worker: this file's folder is not on the actors' import path, and
    # a function from this (__main__) file is shipped to them by value.
    sys.path.insert(0, HERE)
    import train_digits

    return train_digits.main(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="ranks, one Ray actor each")
    p.add_argument("--cpus-per-worker", type=float, default=1)
    p.add_argument("--address", help="a running Ray cluster's address (default: start one)")
    p.add_argument("train_args", nargs="*", help="after --: train_digits.py's arguments")
    args = p.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=int(args.workers * args.cpus_per_worker + 0.999),
                 include_dashboard=False)
    with RayExecutor(num_workers=args.workers, cpus_per_worker=args.cpus_per_worker) as ex:
        accuracies = ex.run(train, args=(args.train_args,))
    print(f"final test accuracy under Ray ({args.workers} workers): {accuracies[0]:.2%}")


if __name__ == "__main__":
    main()
