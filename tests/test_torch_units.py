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
