"""Run a totalreduce job on a Ray cluster, in the style of ``horovod.ray.RayExecutor``.

    from totalreduce.ray import RayExecutor

    def train() -> float:
        import totalreduce.torch as hvd
        hvd.init()
        ...
        return accuracy

    with RayExecutor(num_workers=4) as executor:
        accuracies = executor.run(train)   # one result per rank, in rank order

Needs the ``ray`` extra (``pip install 'totalreduce[ray]'``).
"""

from .executor import RayExecutor
from .failures import WorkerFailedError

__all__ = ["RayExecutor", "WorkerFailedError"]
