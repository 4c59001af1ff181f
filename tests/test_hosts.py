"""Jobs whose ranks sit on different hosts: which links carry what, and the hierarchical
allreduce.  Here every rank names its host with TOTALREDUCE_HOST_ID, so one machine plays
several; test_simulated_hosts.py runs real network namespaces over rate-limited links."""

import pytest

from harness import run_ok

pytestmark = pytest.mark.multiprocess

ENV = {"TOTALREDUCE_SEGMENT_BYTES": "65536"}


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 1, 0, 1)])
def test_hierarchical_allreduce_matches_numpy(hosts: tuple[int, ...]) -> None:
    n = len(hosts)
    result = run_ok(n, "workers:hosts_allreduce", {"hosts": hosts},
                    env={**ENV, "TOTALREDUCE_HIERARCHICAL": "on"}, timeout=200)
    numbered = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    for r in range(n):
        got = result.report(r)
        assert got["checked"] > 0, result.explain()
        assert got["hosts"] == [numbered[h] for h in hosts]
        # Shared-memory rings only to the ranks of its own host; the others over sockets.
        assert got["rings"] == [p for p in range(n) if p != r and hosts[p] == hosts[r]]
        # Each rank sends its half of the buffer's half-share across (2 hosts: a ring
        # allreduce of 1/2 the buffer between two ranks sends 1/2 of that each way).
        moved, nbytes = got["moved"], got["nbytes"]
        assert nbytes // 2 <= moved["tcp_bytes_sent"] < nbytes // 2 + (64 << 10), got
        assert moved["shm_bytes_sent"] >= nbytes // 2, got


def test_flat_allreduce_across_hosts_sends_more_over_the_network() -> None:
    # The comparison that makes the test above mean something: the flat ring over the same
    # layout puts 2 (n - 1) / n = 1.5 buffers through rank 1's link to rank 2.
    hosts = (0, 0, 1, 1)
    result = run_ok(4, "workers:hosts_allreduce", {"hosts": hosts},
                    env={**ENV, "TOTALREDUCE_HIERARCHICAL": "off"}, timeout=200)
    for r in (1, 3):
        got = result.report(r)
        assert got["moved"]["tcp_bytes_sent"] >= got["nbytes"] * 3 // 2, got
    # Rank 0 sends its pieces to rank 1, on its host; a few headers (READY) go across.
    assert result.report(0)["moved"]["tcp_bytes_sent"] < 4096
