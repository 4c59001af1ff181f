"""Two hosts of two ranks each, simulated with network namespaces joined by 1 Gbit/s links
(totalreduce.bench.simhosts; root only), ranks started with srun's environment."""

import pytest

from harness import PROMPTLY, launch, run_ok
from totalreduce.bench.simhosts import SimulatedHosts, unavailable
from workers import WIDTHS

WHY = unavailable()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(WHY is not None, reason=str(WHY))]


@pytest.fixture(scope="module")
def hosts():
    with SimulatedHosts(2, rate="1gbit", delay="100us") as made:
        yield made


def test_every_collective_matches_numpy_across_hosts(hosts: SimulatedHosts) -> None:
    # As over TCP alone in test_collectives: a dtype of each width and kind.
    result = run_ok(4, "workers:check_collectives", {"dtypes": WIDTHS}, hosts=hosts,
                    timeout=240, env={"TOTALREDUCE_SEGMENT_BYTES": "4096"})
    for r in range(4):
        got = result.report(r)
        assert got.get("checked", 0) > 0, result.explain()
        assert got["rings"] == [r ^ 1], got  # shared memory with its host's other rank only


def test_allreduce_across_hosts_is_hierarchical_and_uses_both_links(
        hosts: SimulatedHosts) -> None:
    # Left to auto: the job spans two hosts of two ranks, so a 4 MiB allreduce goes
    # hierarchical: half the buffer over shared memory, a quarter each way across.
    result = run_ok(4, "workers:hosts_allreduce", {}, hosts=hosts, timeout=240,
                    env={"TOTALREDUCE_SEGMENT_BYTES": "65536"})
    for r in range(4):
        got = result.report(r)
        assert got["hosts"] == [0, 0, 1, 1], result.explain()
        assert got["rings"] == [r ^ 1], got
        moved, nbytes = got["moved"], got["nbytes"]
        assert nbytes // 2 <= moved["tcp_bytes_sent"] < nbytes // 2 + (64 << 10), got
        assert moved["shm_bytes_sent"] >= nbytes // 2, got


def test_killed_rank_fails_every_rank_on_both_hosts(hosts: SimulatedHosts) -> None:
    result = launch(4, "workers:killed_peer", {"victim": 1}, hosts=hosts, timeout=90)
    assert result.returncode != 0, result.explain()
    for r in (0, 2, 3):
        got = result.report(r)
        assert got.get("caught_rank") == 1, result.explain()
        assert got["after_s"] < PROMPTLY, got
