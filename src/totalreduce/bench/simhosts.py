"""Hosts simulated on one machine, for tests and benchmarks of jobs that span hosts.

Each host is a network namespace with a hostname of its own (a UTS namespace per rank
process, so totalreduce's host identity tells the hosts apart and shared memory is used
only within one), joined to a switch namespace's bridge by a veth pair.  Both directions
of every host's link are shaped by ``netem``: ``rate`` (bits per second, tc's syntax:
``1gbit``) and half of ``delay`` each way, so a packet from one host to another sees the
whole ``delay`` and a host's traffic in each direction is limited to ``rate``, as a host
on a switched network is by its link.  Where the kernel has no ``netem`` a token bucket
(``tbf``) limits the rate alone, and ``delayed`` is False.  Nothing is added to the
caller's own namespace: the hosts' addresses (10.77.0.0/24) exist only inside these
namespaces.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip``, ``tc`` and ``unshare``;
:func:`unavailable` says why not, where not.  Everything is torn down on exit, failures
included: processes started on the hosts are killed, then the namespaces deleted.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from types import TracebackType

_SUBNET = "10.77.0"


def unavailable() -> str | None:
    """Why hosts cannot be simulated here, or None if they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, tc)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} on PATH"
    probe = f"trprobe{secrets.token_hex(3)}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


class SimulatedHosts:
    """``n`` hosts on links of ``rate`` and ``delay``; a context manager.

    >>> with SimulatedHosts(2, rate="1gbit", delay="100us") as hosts:  # doctest: +SKIP
    ...     proc = hosts.popen(0, ["python", "train.py"], env)
    """

    def __init__(self, n: int, rate: str = "1gbit", delay: str = "100us") -> None:
        if n < 1 or n > 250:
            raise ValueError(f"between 1 and 250 hosts, not {n}")
        self.n = n
        self.rate = rate
        self.delay = delay
        # Whether links delay packets: netem does rate and delay; without it (a kernel
        # with no sch_netem) a token bucket limits the rate and there is no delay.
        self.delayed = True
        self._tag = f"tr{secrets.token_hex(3)}"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[str]] = []

    def namespace(self, host: int) -> str:
        return f"{self._tag}h{host}"

    def hostname(self, host: int) -> str:
        return f"{self._tag}-host{host}"

    def address(self, host: int) -> str:
        """Host ``host``'s address on the simulated network."""
        return f"{_SUBNET}.{host + 1}"

    def __enter__(self) -> SimulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _netns(self, name: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", name, *argv])

    def _build(self) -> None:
        switch = f"{self._tag}sw"
        _run(["ip", "netns", "add", switch])
        self._made.append(switch)
        self._netns(switch, "ip", "link", "add", "br0", "type", "bridge")
        self._netns(switch, "ip", "link", "set", "br0", "up")
        half = _half(self.delay)
        for h in range(self.n):
            ns = self.namespace(h)
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            self._netns(ns, "ip", "link", "set", "lo", "up")
            # Created inside the host, then the switch end moved out: no interface ever
            # appears in the caller's namespace.
            self._netns(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name",
                        f"p{h}")
            self._netns(ns, "ip", "link", "set", f"p{h}", "netns", switch)
            self._netns(ns, "ip", "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
            self._netns(ns, "ip", "link", "set", "eth0", "up")
            self._netns(switch, "ip", "link", "set", f"p{h}", "master", "br0")
            self._netns(switch, "ip", "link", "set", f"p{h}", "up")
            for where, dev in ((ns, "eth0"), (switch, f"p{h}")):
                self._shape(where, dev, half)

    def _shape(self, ns: str, dev: str, half: str) -> None:
        if self.delayed:
            shaped = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                           "root", "netem", "rate", self.rate, "delay", half, "limit",
                           "100000"], check=False)
            if shaped.returncode == 0:
                return
            if "unknown" not in shaped.stderr:
                raise OSError(f"tc netem on {dev}: {shaped.stderr.strip()}")
            self.delayed = False  # this kernel has no sch_netem: rate only
        # A token bucket of a millisecond's worth of bytes (at least a 64 KiB GSO packet),
        # and room for 50 ms of queue: TCP fills the link without tail drops.
        burst = max(64 << 10, bits_per_second(self.rate) // 8000)
        self._netns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    self.rate, "burst", str(burst), "latency", "50ms")

    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host``: in its network namespace, under its hostname,
        in a process group of its own (killed on exit)."""
        wrapped = ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "--",
                   "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(host), *argv]
        proc: subprocess.Popen[str] = subprocess.Popen(
            wrapped, env=env, text=True, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        for ns in reversed(self._made):
            _run(["ip", "netns", "del", ns], check=False)
        self._made.clear()


def bits_per_second(rate: str) -> int:
    """tc's rate syntax (``1gbit``, ``100mbit``, ``10gbit``, ``500kbit``) in bits/s."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit, kbit or bit")


def _half(delay: str) -> str:
    """Half of a tc time (``100us`` -> ``50us``): each end of a link adds half."""
    for unit in ("us", "ms", "s"):
        if delay.endswith(unit):
            value = float(delay[: -len(unit)])
            return f"{value / 2:g}{unit}"
    return f"{float(delay) / 2:g}us"
