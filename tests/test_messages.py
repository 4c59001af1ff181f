"""Point-to-point messages (send / recv) on real ranks, over every transport."""

import pytest

from harness import TRANSPORTS, run_ok
from shared_jobs import shared_job

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_recv(transport: str) -> None:
    n = 3 if transport == "shm" else 2
    result = run_ok(n, "message_workers:messages", {}, timeout=120, transport=transport,
                    env={"TOTALREDUCE_SEGMENT_BYTES": "65536"})
    for r in range(n):
        got = result.report(r)
        assert got.get("ok"), result.explain()
        assert got["after"] == [n] * 3
        bad = got["bad"]
        assert bad["self"].startswith(f"ValueError: rank {r}: send: dest is this rank"), bad
        assert f"dest {n} is not a rank of this job (0..{n - 1})" in bad["dest"], bad
        assert "tag must be an int in 0..32767, got -1" in bad["tag"], bad
        assert bad["buf"].startswith(f"TypeError: rank {r}: recv: buf must be"), bad
    zero = result.report(0)
    assert zero["tag_order"] == [0, 1, 2] and zero["other_tag"] == [70, 70]
    assert zero["any_sources"] == list(range(1, n))
    assert zero["any_async"] == [[0, 1, 2], n - 1]
    # The receiver names both ranks and what differs; the sender's message had left, so
    # its send succeeded (as MPI_Send may return before the receive is posted).
    text = result.report(1)["mismatch"]
    assert text.startswith("MismatchError: rank 1: ranks disagree on recv from rank 0 "
                           "(tag 9, message #0) (differs: count)"), text
    assert "rank 0: dtype=float32, count=10 (as seen in its message header)" in text, text
    assert "rank 1: kind=message, dtype=float32, count=11" in text, text
    assert result.report(0)["mismatch"] == "no error"


def test_receive_from_a_rank_that_left_fails() -> None:
    result = run_ok(2, "message_workers:departed", {}, timeout=60)
    got = result.report(0)
    # Worded by whether the goodbye came before the receive was posted or after.
    named = got["named"]
    assert named.startswith("PeerFailureError: rank 0: ") and "shut down" in named, got
    assert "recv from rank 1 (tag 0, message #0)" in named, got
    assert got["anyone"].startswith("PeerFailureError: rank 0: recv from any rank (tag 0): "
                                    "rank 1 shut down"), got


def test_send_recv_tensors() -> None:
    pytest.importorskip("torch")
    result = shared_job(3).part("messages")
    assert all(result.report(r).get("ok") for r in range(3)), result.explain()
    assert result.report(0)["seen"] == [1, 2]
