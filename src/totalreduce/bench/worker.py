"""One rank of a benchmark job: ``python -m totalreduce.bench.worker CONFIG OUT``.

Runs the measurements CONFIG (JSON) asks for with one backend and writes this rank's raw
timings to ``OUT.<rank>`` as JSON; the parent process merges the ranks.  Every timed call
starts right after a barrier, so per-rank times line up rep by rep.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from typing import Any

import numpy as np

from .backends import Backend, make_backend
from .models import MODELS


def element_count(op: str, nbytes: int, size: int) -> int:
    count = max(1, nbytes // 4)
    if op in ("allgather", "alltoall", "reducescatter"):
        count = max(size, count // size * size)
    return count


def reps_for(nbytes: int, scale: float) -> int:
    base = 200 if nbytes <= 64 << 10 else 50 if nbytes <= 1 << 20 else \
        20 if nbytes <= 16 << 20 else 8
    return max(3, int(base * scale))


def _timed(backend: Backend, step: Any, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        backend.barrier()
        step()
    times = []
    for _ in range(reps):
        backend.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _grads(model: str) -> tuple[list[np.ndarray], np.ndarray]:
    shapes = MODELS[model]()
    total = sum(math.prod(s) for s in shapes)
    flat = np.full(total, 1e-3, np.float32)
    grads, offset = [], 0
    for shape in reversed(shapes):  # backward order, as views of one flat buffer
        n = math.prod(shape)
        grads.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return grads, flat


def collectives(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for op in cfg["ops"]:
        for nbytes in cfg["sizes"]:
            count = element_count(op, nbytes, b.size)
            try:
                step = b.collective(op, count, cfg.get("arrays", "numpy"))
                times = _timed(b, step, reps_for(nbytes, cfg["reps_scale"]))
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                if b.name != "gloo":  # only gloo lacks ops; elsewhere it is a bug
                    raise
                out.append({"op": op, "bytes": nbytes, "count": count,
                            "unsupported": str(exc).splitlines()[0][:200]})
                continue
            out.append({"op": op, "bytes": nbytes, "count": count, "times": times})
    return out


def replay(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every mode of a model, interleaved rep by rep: the host's slow periods (they come
    and go over seconds) then slow all modes alike instead of whichever ran then."""
    out = []
    for model in cfg["models"]:
        grads, flat = _grads(model)
        steps: dict[str, Any] = {}
        for bucket_mb in cfg["buckets_mb"]:
            for mode, step in b.replay_modes(grads, flat, bucket_mb << 20).items():
                steps.setdefault(mode, step)  # per-tensor and flat do not depend on it
        times: dict[str, list[float]] = {mode: [] for mode in steps}
        for step in steps.values():  # warm-up
            b.barrier()
            step()
        for _ in range(cfg["reps"]):
            for mode, step in steps.items():
                b.barrier()
                t = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t)
        out += [{"model": model, "mode": mode, "times": ts} for mode, ts in times.items()]
        del grads, flat, steps
    return out


def skew(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    grads, flat = _grads(cfg["model"])
    out = []
    for rep in range(cfg["reps"] + 1):
        rng = np.random.default_rng([cfg["seed"], rep, b.rank])
        ready = (rng.random(len(grads)) * cfg["max_delay"]).tolist()
        order = sorted(range(len(grads)), key=ready.__getitem__)
        b.barrier()
        t0 = time.perf_counter()
        b.submit_when_ready(grads, order, ready, t0)
        elapsed = time.perf_counter() - t0
        if rep:  # the first is a warm-up
            out.append({"elapsed": elapsed, "last_ready": max(ready)})
    flat_times = _timed(b, b.replay_modes(grads, flat, 1 << 30)["flat"], cfg["reps"], 1)
    return [{"model": cfg["model"], "iterations": out, "flat_times": flat_times}]


def preempt(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    big = np.ones(cfg["big_bytes"] // 4, np.float32)
    small = np.ones(max(1, cfg["small_bytes"] // 4), np.float32)
    out = []
    modes = [True, False] if b.name.startswith("totalreduce") else [False]
    alone = _timed(b, b.collective("allreduce", small.size), cfg["reps"])
    out.append({"mode": "small alone", "times": alone})
    # The same call as during the big op, after the same sleep: waking from it costs more
    # than the op (MPI's 1 KB allreduce: 7 us back to back, 46 us after a 2 ms sleep on
    # 2 cores), so this, not the back-to-back time, is what the big op adds to.
    first = b.name.startswith("totalreduce")
    delayed = []
    for _ in range(cfg["reps"]):
        b.barrier()
        delayed.append(b.preempt(None, small, cfg["delay"], first))
    out.append({"mode": "small alone after the delay", "times": delayed})
    for prio in modes:
        times = []
        for _ in range(cfg["reps"]):
            b.barrier()
            times.append(b.preempt(big, small, cfg["delay"], prio))
        label = "during big, priority on" if prio else (
            "during big, priority off" if b.name.startswith("totalreduce")
            else "during big (no priorities)")
        out.append({"mode": label, "times": times})
    return out


def latency(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Blocking 8-byte allreduces, then barriers, then the backend's other small calls
    (Backend.small_calls), back to back as a training loop calls them (no barrier
    between two): each call's own time.  All are latency-bound."""
    out = []
    for mode, step in (("allreduce 8 B", b.collective("allreduce", 2)),
                       ("barrier", b.barrier), *b.small_calls().items()):
        for _ in range(cfg["warmup"]):
            step()
        b.barrier()
        times = []
        for _ in range(cfg["reps"]):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        out.append({"mode": mode, "times": times})
    return out


def tiny(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Many async 4-byte allreduces submitted at once, then waited: per-op overhead."""
    count = cfg["count"]
    times = _timed(b, b.tiny(count), cfg["reps"])
    return [{"mode": f"{count} x 4 B async", "times": [t / count for t in times]}]


def _digits_gradients(rank: int, calls: int) -> list[np.ndarray]:
    """Gradients of the digits example's MLP (64-256-128-10, 50,890 values) on this rank's
    batches of scikit-learn's digits, taken along a short SGD run."""
    import torch
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    from .convergence import digits_mlp

    torch.manual_seed(0)
    model = digits_mlp()
    x, y = load_digits(return_X_y=True)
    xs = torch.tensor(x / 16.0, dtype=torch.float32)
    ys = torch.tensor(y)
    g = torch.Generator().manual_seed(rank)
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(calls):
        idx = torch.randint(0, len(xs), (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                              if p.grad is not None]).numpy().copy())
        opt.step()
    return out


def sparse(b: Backend, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each sparse algorithm against dense on the same gradients: time per call, payload
    words sent and received per rank in units of k, output nonzeros."""
    if not b.name.startswith("totalreduce"):
        return [{"mode": "-", "unsupported": "totalreduce only"}]
    from .. import compression

    calls = cfg["calls"]
    sources: dict[str, list[np.ndarray]] = {}
    rng = np.random.default_rng([7, b.rank])
    sources["heavy-tailed"] = [(rng.standard_t(2, cfg["n"]) * 1e-2).astype(np.float32)
                               for _ in range(calls)]
    if importlib.util.find_spec("torch") and importlib.util.find_spec("sklearn"):
        sources["digits MLP"] = _digits_gradients(b.rank, calls)
    out = []
    for source, grads in sources.items():
        for density in cfg["densities"]:
            algs = {"dense": compression.Dense(), "topka": compression.TopkA(density),
                    "gtopk": compression.GTopk(density),
                    "gtopk-exact": compression.GTopk(density, exact_sums=True),
                    "oktopk": compression.OkTopk(density, warmup=1),
                    "oktopk-1a2a": compression.OkTopk(density, warmup=1, pipeline=False)}
            for name, alg in algs.items():
                times, words, recv, nnz = [], [], [], 0
                for call, grad in enumerate(grads):
                    b.barrier()
                    t = time.perf_counter()
                    result = alg.allreduce(grad, f"g.{source}.{density}")
                    elapsed = time.perf_counter() - t
                    st = alg.stats(f"g.{source}.{density}")
                    if call >= 2:  # past Ok-Topk's warm-up and first exact thresholds
                        k = max(1, int(grad.size * density))
                        times.append(elapsed)
                        words.append((st["bytes_sent"] - 64 * st["messages_sent"]) / 4 / k)
                        recv.append((st["bytes_received"] - 64 * st["messages_received"])
                                    / 4 / k)
                    nnz = int(np.count_nonzero(result))
                out.append({"mode": f"{source} {density:g} {name}", "times": times,
                            "words_per_k": float(np.median(words)),
                            "recv_per_k": float(np.median(recv)), "nnz": nnz,
                            "n": int(grads[0].size)})
    return out


TESTS = {"collectives": collectives, "replay": replay, "skew": skew, "preempt": preempt,
         "tiny": tiny, "sparse": sparse, "latency": latency}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out_path = sys.argv[2]
    if cfg["test"] in ("train", "convergence"):  # each sets up its own framework
        if cfg["test"] == "train":
            from .training import train as run
        else:
            from .convergence import convergence as run

        rank, size, results = run(cfg["backend"], cfg)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump({"rank": rank, "size": size, "results": results}, f)
        return
    backend = make_backend(cfg["backend"])
    try:
        results = TESTS[cfg["test"]](backend, cfg)
        with open(f"{out_path}.{backend.rank}", "w") as f:
            json.dump({"rank": backend.rank, "size": backend.size, "results": results}, f)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
