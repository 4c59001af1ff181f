"""Worker functions of the sparse allreduce tests (test_compression.py): Ok-Topk, TopkA
and gTopk on every rank, checked against numpy and the conservation identity on every
call (see harness.py for how a test runs them)."""

from __future__ import annotations

import time

import numpy as np

import totalreduce as tr
from reporting import report


def sparse_allreduce(arg: dict) -> None:
    """One sparse algorithm over several calls: identical outputs on every rank, the
    conservation identity on every call, warm-up calls equal to dense, measured volume."""
    tr.init()
    got = _sparse_run(arg, "g")
    tr.shutdown()
    report(**got)


def sparse_allreduce_cases(arg: dict) -> None:
    """``sparse_allreduce`` for each of ``arg["cases"]`` in turn in one job (each its own
    algorithm object and tensor name), reported under ``case:<key>``.  A failed check is
    reported under its case before it ends the job, so the test names the case."""
    tr.init()
    for key, case in arg["cases"].items():
        start = time.perf_counter()
        try:
            got = _sparse_run(case, f"g.{key}")
            got["seconds"] = time.perf_counter() - start
        except AssertionError as exc:
            report(**{f"case:{key}": {"error": f"{key}: {exc}"}})
            raise
        report(**{f"case:{key}": got})
    tr.shutdown()


def _sparse_run(arg: dict, name: str) -> dict:
    """Every call: identical outputs on every rank, and the conservation identity; for
    published gTopk, which does not conserve, the output, residuals and loss against
    ``_gtopk_reference`` instead.  With momentum correction in the kwargs, what goes in
    on each call is the velocity, recomputed here in numpy from the gradients (clipped as
    the algorithm clips them, masked where a rank's value was sent); the algorithm's own
    velocity must match it.  ``roundtrip``: a second object loaded from the first's
    state_dict must go on exactly as the first does."""
    from totalreduce import compression

    rank, n_ranks = tr.rank(), tr.size()
    n, calls = arg["n"], arg["calls"]
    kind = arg["alg"]
    kwargs = dict(arg.get("kwargs", {}))
    if kind == "gtopk-exact":
        kwargs["exact_sums"] = True
    cls = {"oktopk": compression.OkTopk, "topka": compression.TopkA,
           "gtopk": compression.GTopk, "gtopk-exact": compression.GTopk}[kind]
    alg = cls(arg["density"], **kwargs)
    published = kind == "gtopk"
    dtype = np.dtype(arg.get("dtype", "float32"))
    momentum = kwargs.get("momentum", 0.0)
    masking = kwargs.get("momentum_masking", True)
    clip = kwargs.get("clip_norm")
    warm = kwargs.get("warmup", 10 if kind == "oktopk" else 0)
    dense_calls = warm if kwargs.get("warmup_mode", "dense") == "dense" else 0
    old = np.zeros((n_ranks, n), dtype)
    velocity = np.zeros((n_ranks, n), dtype)
    volumes = []
    worst = worst_velocity = 0.0
    lost, moved = 0.0, 0.0
    for call in range(calls):
        rng = np.random.default_rng([arg["seed"], call])
        if "nonzero" in arg:
            # Values at a random ``nonzero`` share of the places, zeros elsewhere: drawing
            # all of tens of millions of values was half the job's time.
            m = int(n * arg["nonzero"])
            grads = np.zeros((n_ranks, n), dtype)
            for p in range(n_ranks):
                grads[p, rng.integers(0, n, m)] = rng.standard_t(2, m) * 1e-2
        else:
            grads = (rng.standard_t(2, size=(n_ranks, n)) * 1e-2).astype(dtype)
        case = arg.get("case")
        if case == "silent_rank":
            grads[n_ranks - 1] = 0  # one rank selects nothing
        elif case == "zeros":
            grads[:] = 0
        elif case == "ties":
            grads = np.round(grads * 20) / 20  # many equal magnitudes at the threshold
        if clip is not None:
            limit = clip / np.sqrt(n_ranks)
            for p in range(n_ranks):
                norm = float(np.linalg.norm(grads[p].astype(np.float64)))
                if norm > limit:
                    grads[p] = (grads[p] * (limit / norm)).astype(dtype)
        if momentum:
            velocity = (momentum * velocity + grads).astype(dtype)
            inputs = velocity
        else:
            inputs = grads
        out = alg.allreduce(grads[rank], name)
        every_out = tr.allgather(out.reshape(1, n))
        assert all(np.array_equal(every_out[0], o) for o in every_out), "outputs differ"
        new = tr.allgather(alg.residual(name).reshape(1, n))
        # Where every term is zero (0.0 or -0.0) both sides are 0, so the identity is
        # summed, in float64, only at the places where some term is not (NaN and inf
        # included): at tens of millions of values, mostly zeros, float64 sums of all
        # of them cost most of the job.  Without float64 copies of the (ranks, n)
        # arrays, for the same reason.
        at = np.flatnonzero((out != 0) | (new != 0).any(axis=0) | (inputs != 0).any(axis=0)
                            | (old != 0).any(axis=0))
        lhs = n_ranks * out[at].astype(np.float64) + new[:, at].sum(axis=0, dtype=np.float64)
        rhs = inputs[:, at].sum(axis=0, dtype=np.float64) + \
            old[:, at].sum(axis=0, dtype=np.float64)
        scale = max(1.0, float(np.abs(rhs).max(initial=0.0)))
        if published and rank != 0:
            err = 0.0  # rank 0 checks every rank's output and residual (they are gathered)
        elif published:
            # The loss is the identity's whole gap.
            accs = inputs + old
            want, sels, gone = _gtopk_reference(accs, alg.k(n, call))
            assert np.array_equal(out, want / np.array(n_ranks, dtype)), \
                f"call {call}: output differs from the tree merge"
            winners = np.flatnonzero(want)
            for p in range(n_ranks):
                res = accs[p].copy()
                res[np.intersect1d(sels[p], winners)] = 0
                assert np.array_equal(new[p], res), f"call {call}: rank {p}'s residual"
            err = float(np.abs(lhs - rhs + gone[at]).max(initial=0.0)) / scale
            lost += float(np.abs(gone).sum())
            moved += float(np.abs(want.astype(np.float64) + gone).sum())
        else:
            err = float(np.abs(lhs - rhs).max(initial=0.0)) / scale
        worst = max(worst, err)
        assert err < 1e-5, f"call {call}: conservation off by {err}"
        if call < dense_calls:
            dense = tr.allreduce(inputs[rank] + old[rank], op=tr.Average)
            assert np.array_equal(out, dense), "a warm-up call differs from dense"
        if momentum:
            if masking and call >= dense_calls:
                # Sent: what was in the accumulator and is not in the residual now.
                velocity[((inputs + old) != 0) & (new == 0)] = 0
            got = tr.allgather(alg.velocity(name).reshape(1, n))
            off = float(np.abs(got.astype(np.float64) - velocity).max())
            worst_velocity = max(worst_velocity, off / max(1.0, float(np.abs(velocity).max())))
            assert worst_velocity < 1e-6, f"call {call}: velocity off by {off}"
        st = alg.stats(name)
        volumes.append({"call": call, "bytes_sent": st["bytes_sent"],
                        "bytes_received": st["bytes_received"],
                        "messages_sent": st["messages_sent"],
                        "messages_received": st["messages_received"], "k": st["k"],
                        "local": st["local_selected"], "global": st["global_selected"]})
        old = new.astype(dtype)
    if arg.get("roundtrip"):
        twin = cls(arg["density"], **kwargs)
        twin.load_state_dict(alg.state_dict())
        mine, theirs = alg.velocity(name), twin.velocity(name)
        assert (mine is None) == (theirs is None), "velocity lost in the round trip"
        assert mine is None or np.array_equal(mine, theirs), "velocity changed"
        rng = np.random.default_rng([arg["seed"], calls])
        grad = (rng.standard_t(2, size=(n_ranks, n)) * 1e-2).astype(dtype)[rank]
        outs = [a.allreduce(grad, name) for a in (alg, twin)]  # in turn: collective
        assert np.array_equal(outs[0], outs[1]), "outputs part after the round trip"
        assert np.array_equal(alg.residual(name), twin.residual(name)), "residuals part"
        assert mine is None or np.array_equal(alg.velocity(name), twin.velocity(name)), \
            "velocities part after the round trip"
    nz = np.flatnonzero(out)
    return {"volumes": volumes, "worst": worst, "worst_velocity": worst_velocity,
            "nonzero": int(nz.size), "last_nonzero": int(nz[-1]) if nz.size else -1,
            "lost": lost, "lost_fraction": lost / moved if moved else 0.0}


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest magnitudes (never zeros), ties to the lower index."""
    nz = np.flatnonzero(values)
    if nz.size > k:
        mag = np.abs(values[nz])
        nz = nz[mag >= np.partition(mag, nz.size - k)[nz.size - k]]
        nz = nz[np.lexsort((nz, -np.abs(values[nz])))[:k]]
    return np.sort(nz)


def _gtopk_reference(accs: np.ndarray, k: int) -> tuple[np.ndarray, list, np.ndarray]:
    """Published gTopk on every rank's ``acc`` at once, on dense arrays: (the merged
    values at the global winners, zeros elsewhere; each rank's own selection; the loss:
    at each winner, the sum of the selected contributions some merge dropped)."""
    size, n = accs.shape
    sels = [_top(a, k) for a in accs]
    held = np.zeros_like(accs)
    alive = np.zeros((size, n), bool)  # rank p's value at i is still in its subtree's set
    for p, s in enumerate(sels):
        held[p, s] = accs[p, s]
        alive[p, s] = True
    step = 1
    while step < size:
        for dst in range(0, size, 2 * step):
            if dst + step < size:
                total = held[dst] + held[dst + step]
                held[dst] = 0
                keep = _top(total, k)
                held[dst, keep] = total[keep]
                kept = np.zeros(n, bool)
                kept[keep] = True
                alive[dst:dst + 2 * step] &= kept
        step *= 2
    want = held[0]
    won = np.zeros(n, bool)
    won[np.flatnonzero(want)] = True
    gone = np.zeros(n)
    for p, s in enumerate(sels):
        dropped = s[won[s] & ~alive[p, s]]
        gone[dropped] += accs[p, dropped].astype(np.float64)
    return want, sels, gone
