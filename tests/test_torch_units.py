"""One-process checks of the torch layer's pure parts: bucket plans, staging, compressors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from totalreduce.torch import buckets  # noqa: E402
from totalreduce.torch.compression import Compression  # noqa: E402
from totalreduce.torch.tensors import check_tensor, stage  # noqa: E402

F32 = torch.float32


def test_buckets_walk_backward_and_close_at_the_cap() -> None:
    sizes = [(100, F32, "cpu"), (100, F32, "cpu"), (150, F32, "cpu"), (50, F32, "cpu")]
    assert buckets.plan(sizes, 200) == [[3, 2], [1, 0]]
    # A parameter bigger than the cap gets a bucket of its own.
    assert buckets.plan([(500, F32, "cpu"), (10, F32, "cpu")], 100) == [[1], [0]]


def test_buckets_keep_dtypes_apart() -> None:
    sizes = [(8, F32, "cpu"), (8, torch.float64, "cpu"), (8, F32, "cpu")]
    plan = buckets.plan(sizes, 1 << 20)
    assert sorted(map(sorted, plan)) == [[0, 2], [1]]


def test_bucket_views_share_the_flat_buffer() -> None:
    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))]
    (bucket,) = buckets.build(["a", "b"], params, 1 << 20)
    assert bucket.names == ["b", "a"]
    bucket.flat.fill_(2.0)
    assert torch.equal(bucket.views[1], torch.full((3, 2), 2.0))
    assert bucket.owns(1, bucket.views[1]) and not bucket.owns(0, bucket.views[1])


def test_digest_tells_shapes_apart() -> None:
    a = buckets.describe(["w"], [torch.nn.Parameter(torch.ones(3, 2))])
    b = buckets.describe(["w"], [torch.nn.Parameter(torch.ones(2, 3))])
    assert buckets.digest(a) != buckets.digest(b)
    assert buckets.digest(a) == buckets.digest(list(a))


def test_cpu_tensors_are_staged_without_a_copy() -> None:
    t = torch.arange(6, dtype=torch.float32, requires_grad=True)
    staged = stage(t, "test")
    assert staged.zero_copy and staged.array.ctypes.data == t.data_ptr()
    b = torch.ones(4, dtype=torch.bool)
    assert stage(b, "test").zero_copy


def test_bfloat16_travels_as_float32_and_comes_back() -> None:
    t = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    staged = stage(t, "test")
    assert not staged.zero_copy and str(staged.array.dtype) == "float32"
    staged.array *= 2
    staged.write_back()
    assert torch.equal(t, torch.tensor([3.0, -4.5], dtype=torch.bfloat16))
    assert staged.result(staged.array).dtype == torch.bfloat16


def test_unsupported_tensors_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="complex64 is not supported"):
        check_tensor(torch.ones(2, dtype=torch.complex64), "allreduce")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        check_tensor([1.0], "allreduce")


def test_fp16_compression_round_trip() -> None:
    t = torch.tensor([1.0, 2.5, -3.0], dtype=torch.float64)
    wire, ctx = Compression.fp16.compress(t)
    assert wire.dtype == torch.float16
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.equal(back, t)
    ints = torch.tensor([1, 2])
    assert Compression.fp16.compress(ints)[0] is ints


def test_torch_state_round_trips_model_optimizer_and_scalars(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import numpy as np

    import totalreduce.torch as hvd
    from totalreduce.recovery.codec import decode, encode

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        return net, torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.9))

    net, opt = build(0)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    state = hvd.TorchState(net, opt, epoch=7, history=np.arange(6.0).reshape(2, 3))
    kept = decode(encode(state.as_arrays()))  # what a checkpoint keeps, without pickle
    assert kept is not None

    other_net, other_opt = build(1)
    other = hvd.TorchState(other_net, other_opt, epoch=1, history=np.zeros((0, 3)))
    other.restore_arrays(kept)
    assert other.epoch == 7 and other.history.tolist() == [[0, 1, 2], [3, 4, 5]]
    for (name, a), (_, b) in zip(net.state_dict().items(), other_net.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    mine, theirs = opt.state_dict(), other_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for pid, slots in mine["state"].items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs["state"][pid][key]))
            assert torch.as_tensor(value).dtype == torch.as_tensor(theirs["state"][pid][key]).dtype

    # In a world of one, through the public checkpoint: a fresh start gets nothing, the
    # next load gets the checkpoint.
    for var in ("TOTALREDUCE_RANK", "RANK", "SLURM_PROCID", "PMI_RANK",
                "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    hvd.init()
    try:
        assert other.load() == 0 and other.epoch == 7
        state.epoch = 8
        state.checkpoint()
        assert hvd.version_number() == 1 and other.load() == 1 and other.epoch == 8
    finally:
        hvd.shutdown()


def test_autotune_tries_each_setting_then_keeps_the_fastest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from totalreduce.torch import autotune

    default = autotune.Setting(16 << 20, True)
    # A model of 3 MiB: 1 MiB buckets give 3, 4 MiB and up give 1, like the default.
    tried = autotune.candidates(default, lambda cap: 3 if cap < (3 << 20) else 1, True)
    assert tried == [default, autotune.Setting(16 << 20, False),
                     autotune.Setting(1 << 20, True), autotune.Setting(1 << 20, False)]
    assert autotune.candidates(default, lambda cap: 1, False) == tried[:2]

    # Each setting's steps take a known time; the agreed time is the slowest rank's.
    cost = {tried[0]: 0.30, tried[1]: 0.20, tried[2]: 0.25, tried[3]: 0.40}
    agreed: list[int] = []

    def agree(seconds: float, trial: int) -> float:
        agreed.append(trial)
        return seconds + 0.01  # another rank was a little slower

    now = [0.0]
    log = tmp_path / "tune" / "trials.csv"
    tuner = autotune.Autotuner(tried, agree, str(log), warmup=2, timed=3,
                               clock=lambda: now[0])
    current, switches, since = tried[0], [], 0
    for _ in range(100):
        since += 1
        # The first steps after a switch are slow (new buckets): warm-up, not timed.
        now[0] += cost[current] + (1.0 if since <= 3 else 0.0)
        nxt = tuner.stepped()
        if nxt is not None:
            switches.append(nxt)
            current, since = nxt, 0
    assert switches == tried[1:] + [tried[1]]
    assert agreed == [0, 1, 2, 3]
    assert [round(s, 2) for _, s in tuner.results] == [0.31, 0.21, 0.26, 0.41]
    assert tuner.done and tuner.chosen == tried[1]
    rows = log.read_text().splitlines()
    assert rows[0] == "trial,bucket_bytes,overlap,seconds_per_step,chosen"
    assert rows[2] == f"1,{16 << 20},0,0.210000,1" and len(rows) == 5


def test_torch_state_keeps_a_sparse_compressions_numpy_state() -> None:
    """The DistributedOptimizer's state_dict carries a sparse compression's residuals and
    velocities as numpy arrays; a checkpoint keeps them (as copies: the velocity of the
    next step must not reach into the checkpoint)."""
    import json

    import numpy as np

    from totalreduce.compression import OkTopk
    from totalreduce.torch.checkpoint import _flatten, _unflatten

    alg = OkTopk(0.01, momentum=0.9)
    alg.load_state_dict({"sparse.b0": {
        "residual": np.arange(4, dtype=np.float32), "velocity": np.ones(4, np.float32),
        "calls": 3, "local_threshold": 0.5, "global_threshold": 0.25,
        "boundaries": np.array([0, 2, 4]), "last_local": 1, "stats": {"global_selected": 2}}})
    sparse = alg.state_dict()
    skeleton, arrays = _flatten({"state": {}, "totalreduce_sparse": sparse}, [])
    back = _unflatten(json.loads(json.dumps(skeleton)), arrays)["totalreduce_sparse"]
    for key, value in sparse["sparse.b0"].items():
        got = back["sparse.b0"][key]
        if isinstance(value, np.ndarray):
            assert np.array_equal(got, value) and got.dtype == value.dtype, key
            assert not np.shares_memory(got, value), key
        else:
            assert got == value, key
