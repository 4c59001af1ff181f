"""Bad input, lost peers, strangers and stalls: every rank fails loudly and quickly."""

import re

import pytest

from harness import launch, run_ok

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("what,values", [
    ("shape", ("(4,)", "(5,)")),
    ("dtype", ("float32", "float64")),
    ("layout", ("(3, 2)", "(2, 3)")),
    ("op", ("op=Average", "op=Max")),
])
def test_mismatch_raises_on_every_rank(what: str, values: tuple[str, str],
                                       transport: str) -> None:
    n = 3
    result = run_ok(n, "workers:mismatch", {"what": what}, timeout=60, transport=transport)
    for r in range(n):
        lines = [ln for ln in result.lines(r) if ln.startswith("MISMATCH")]
        assert len(lines) == 1, result.explain()
        msg = lines[0]
        seconds = float(re.search(r"after ([\d.]+)s", msg).group(1))
        assert seconds < 10, msg
        assert "'grad.w'" in msg and what.replace("layout", "shape") in msg, msg
        assert values[0] in msg and values[1] in msg, msg
        assert "rank 1:" in msg and "rank 0:" in msg, msg


def test_killed_worker_fails_every_rank_and_launcher() -> None:
    n = 3
    result = launch(n, "workers:killed_peer", {"victim": 1}, timeout=60)
    assert result.returncode != 0, result.explain()
    assert result.elapsed < 15, result.explain()
    assert "rank 1" in result.stderr and "SIGKILL" in result.stderr, result.explain()
    assert re.search(r"rank 1 \(pid \d+\) failed: killed by SIGKILL", result.stderr)
    assert re.search(r"1\s+\d+\s+killed by SIGKILL\s+<- first failure", result.stderr)
    for r in (0, 2):
        caught = [ln for ln in result.lines(r) if ln.startswith("CAUGHT")]
        assert caught, result.explain()
        assert caught[0].startswith("CAUGHT rank=1 "), caught
        assert float(re.search(r"after ([\d.]+)s", caught[0]).group(1)) < 10


def test_strangers_are_refused_and_job_finishes() -> None:
    result = run_ok(2, "workers:strangers", {}, timeout=60)
    text = result.stdout + result.stderr
    assert text.count("wrong secret refused") == 2, result.explain()
    assert "rendezvous: refused connection" in text, result.explain()
    assert "rank 1: refused connection" in text, result.explain()
    assert all("job finished correctly" in result.lines(r) for r in range(2))


def test_op_timeout_fails_instead_of_hanging() -> None:
    result = run_ok(2, "workers:op_timeout", {"late": 0.5},
                    env={"TOTALREDUCE_OP_TIMEOUT": "1.5"}, timeout=60)
    for r in range(2):
        lines = [ln for ln in result.lines(r) if ln.startswith("TIMEOUT")]
        assert lines and f"'late{r}'" in lines[0], result.explain()
        assert "TOTALREDUCE_OP_TIMEOUT" in lines[0]
        assert 1.4 < float(re.search(r"after ([\d.]+)s", lines[0]).group(1)) < 5


def test_stall_warning_names_op_and_rank() -> None:
    result = run_ok(2, "workers:stall", {}, env={"TOTALREDUCE_STALL_WARNING": "1"},
                    timeout=60)
    warnings = [ln for ln in result.lines(0) if "has waited" in ln]
    assert warnings, result.explain()
    assert "'slowpoke'" in warnings[0] and "rank(s) [1]" in warnings[0], warnings
