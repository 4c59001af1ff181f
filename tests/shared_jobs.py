"""The torch checks of several test modules, one job per world size, run once per session
(torch_workers.shared): a torch job's start, its imports, takes several seconds of CPU a
rank, most of what each check's own job took.  ``shared_job(n).part(name)`` is part
``name``'s result."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from harness import HERE, Result, run_ok

# 1 KiB buckets: gradients of 256 bytes and more are reduced in their own .grad
# (torch/buckets.py), the smaller ones in a bucket.
EQUIVALENCE_CASES = [{}, {"momentum": True}, {"passes": 2}, {"fp16": True},
                     {"bucket": 1024, "momentum": True}, {"bucket": 1024, "passes": 2},
                     {"bucket": 1024, "fp16": True}, {"bucket": 1024, "keep_grads": True}]
SCRIPT = {"path": str(HERE / "horovod_script.py")}
SPARSE_OPTIMIZER_ALGS = ["oktopk", "topka", "gtopk"]
# Where the 2-rank job's autotuning part logs its trials.
_LOGS = tempfile.mkdtemp(prefix="totalreduce-tests-")
atexit.register(shutil.rmtree, _LOGS, ignore_errors=True)
AUTOTUNE_LOG = str(Path(_LOGS) / "autotune.csv")
# Parts run in negotiated mode (test_negotiated), each in a world started with it.
NEGOTIATED = {"coordination": "negotiated"}
NEGOTIATED_CASES = [{}, {"momentum": True}, {"fp16": True}]

# examples/train_digits.py's runs (test_examples), each as its main() with these
# arguments; a run launched on its own spent most of its time starting the ranks.
DIGITS_10_EPOCHS = ["--epochs", "10"]
DIGITS_CALM = {"argv": ["--epochs", "2", "--print-digest"]}

# The Horovod script runs first, the joins last (of each coordination mode).
PARTS = {
    1: [["script", "horovod_script", SCRIPT], ["misuse", "misuse", {}],
        ["digits", "digits", {"argv": DIGITS_10_EPOCHS}]],
    2: [["script", "horovod_script", SCRIPT], ["collectives", "collectives", {}],
        ["equivalence", "equivalence", {"cases": EQUIVALENCE_CASES}],
        ["overlap", "overlap", {}], ["first_use", "first_use", {}],
        ["parity", "parity_workers:horovod_parity", {}], ["ddp_hook", "ddp_hook", {}],
        ["averaging", "averaging", {}],
        ["sparse_optimizer", "sparse_optimizer", {"algs": SPARSE_OPTIMIZER_ALGS}],
        ["sparse_overlap", "overlap_matches_step", {}], ["sparse_hook", "sparse_ddp_hook", {}],
        ["sparse_small", "sparse_small_buckets_whole", {}],
        ["autotune", "autotune_agrees", {"log": AUTOTUNE_LOG}, {"autotune_log": AUTOTUNE_LOG}],
        ["digits", "digits", DIGITS_CALM],
        ["unused_and_join", "unused_and_join", {}], ["joined", "joined_rank_refuses", {}],
        ["neg_script", "horovod_script", SCRIPT, NEGOTIATED],
        ["neg_equivalence", "equivalence", {"cases": NEGOTIATED_CASES}, NEGOTIATED],
        ["neg_unused_and_join", "unused_and_join", {}, NEGOTIATED],
        ["neg_joined", "joined_rank_refuses", {}, NEGOTIATED]],
    3: [["collectives", "collectives", {}], ["parity", "parity_workers:horovod_parity", {}],
        ["model_mismatch", "model_mismatch", {}], ["unused_and_join", "unused_and_join", {}],
        ["neg_unused_and_join", "unused_and_join", {}, NEGOTIATED],
        # send/recv with 64 KiB segments: the 20,000-element tensors go in pieces.
        ["messages", "messages", {}, {"segment_bytes": 65536}]],
    4: [["script", "horovod_script", SCRIPT],
        ["equivalence", "equivalence", {"cases": EQUIVALENCE_CASES}],
        ["parity", "parity_workers:horovod_parity", {"only": ["adasum"]}],
        ["averaging", "averaging", {}], ["process_sets", "process_set_training", {}],
        ["digits", "digits", {"argv": DIGITS_10_EPOCHS}],
        ["digits_average", "digits", {"argv": [*DIGITS_10_EPOCHS, "--average-period", "4"]}],
        ["digits_adasum", "digits", {"argv": [*DIGITS_10_EPOCHS, "--op", "adasum"]}],
        ["unused_and_join", "unused_and_join", {}]],
}

_JOBS: dict[int, Result] = {}


def shared_job(n: int) -> Result:
    if n not in _JOBS:
        _JOBS[n] = run_ok(n, "torch_workers:shared", {"parts": PARTS[n]}, timeout=270)
    return _JOBS[n]
