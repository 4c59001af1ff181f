"""The credit ledger: how much each peer may still send us ahead of time, and the READYs
that say an op needs no credit any more.

A rank may send a message for an op its peer has not announced only against *credit*,
``TOTALREDUCE_FLOATING_CAP / (n - 1)`` bytes per directed pair.  The receiver owes the
credit back once it has consumed such a message, and returns it on the next header it
sends that way (or in a CREDIT message once a quarter of the budget is owed).  A READY
(its own message, or FLAG_READY on a DATA header) says the sender has submitted the op,
so its peers send to it freely from then on.
"""

from __future__ import annotations

from collections.abc import Callable

from ..lru import LRU
from ..transport.wire import FLAG_CREDITED, HEADER_SIZE, Header
from .payload import OpKey

# READYs for ops not submitted here yet.  Bounded: dropping the stalest costs only credit
# (the sender then sends against credit), never correctness.
_EARLY_READY_ENTRIES = 1 << 16


def charge_of(nbytes: int) -> int:
    """What a body of ``nbytes`` costs in credit (a header's worth at least: an empty
    piece still takes a floating entry)."""
    return max(nbytes, HEADER_SIZE)


def charged(header: Header) -> int:
    """The credit the sender spent on this message (0 for a message that needed none)."""
    return charge_of(header.nbytes) if header.flags & FLAG_CREDITED else 0


class CreditLedger:
    """``want_send(peer)`` asks the transport for a chance to send to ``peer``: called once
    enough credit is owed to it to be worth a message of its own."""

    def __init__(self, peers: list[int], budget: int, want_send: Callable[[int], None]
                 ) -> None:
        self.budget = budget
        self._want_send = want_send
        self._credit = dict.fromkeys(peers, budget)
        self._owed = dict.fromkeys(peers, 0)
        self._return_at = max(1, budget // 4)
        self.early: LRU[OpKey, set[int]] = LRU(_EARLY_READY_ENTRIES)

    # --- what we may send ------------------------------------------------------------

    def spend(self, peer: int, nbytes: int) -> bool:
        """Take the credit for sending ``nbytes`` to ``peer`` ahead of its READY; False
        (nothing taken) when there is not enough."""
        charge = nbytes if nbytes > HEADER_SIZE else HEADER_SIZE  # charge_of, inline
        left = self._credit[peer] - charge
        if left < 0:
            return False
        self._credit[peer] = left
        return True

    def terms(self, peer: int, nbytes: int) -> int:
        """For one message to ``peer`` about to go: take the credit for a body of ``nbytes``
        sent ahead of its READY (-1: none, the peer is ready), and the credit owed to
        ``peer`` (returned: it goes on the message, and is no longer owed); -1, nothing
        taken, when there is not enough.  :meth:`spend` and :meth:`take_owed` in one call,
        for the small ops that pay both on every message."""
        if nbytes >= 0:
            left = self._credit[peer] - (nbytes if nbytes > HEADER_SIZE else HEADER_SIZE)
            if left < 0:
                return -1
            self._credit[peer] = left
        owed = self._owed[peer]
        self._owed[peer] = 0
        return owed

    def settle(self, peer: int, credit: int, flags: int, nbytes: int) -> None:
        """A DATA message from ``peer`` was consumed: it returned ``credit``, and where its
        ``flags`` say FLAG_CREDITED its body of ``nbytes`` cost ``peer`` credit, now owed:
        :meth:`grant` and :meth:`owe` in one call."""
        self._credit[peer] += credit
        if flags & FLAG_CREDITED:
            charge = nbytes if nbytes > HEADER_SIZE else HEADER_SIZE  # charge_of, inline
            owed = self._owed[peer] + charge
            self._owed[peer] = owed
            if owed >= self._return_at:
                self._want_send(peer)

    def grant(self, peer: int, credit: int) -> None:
        """``peer`` returned credit (on any header)."""
        self._credit[peer] += credit

    def credit(self, peer: int) -> int:
        return self._credit[peer]

    # --- what we owe -----------------------------------------------------------------

    def owe(self, peer: int, charge: int) -> None:
        """A message from ``peer`` that cost it ``charge`` credit was consumed."""
        if charge:
            self._owed[peer] += charge
            if self._owed[peer] >= self._return_at:
                self._want_send(peer)

    def due(self, peer: int) -> bool:
        return self._owed[peer] >= self._return_at

    def take_owed(self, peer: int) -> int:
        """The credit to put on the next header to ``peer`` (now no longer owed)."""
        owed = self._owed[peer]
        self._owed[peer] = 0
        return owed

    def restore_owed(self, peer: int, credit: int) -> None:
        """Credit taken for a header that could not be sent is owed again."""
        self._owed[peer] += credit

    # --- READYs of ops not submitted here yet ----------------------------------------

    def early_ready(self, key: OpKey, peer: int) -> None:
        ready = self.early.get(key)
        if ready is None:
            ready = set()
            self.early.put(key, ready)
        ready.add(peer)

    def pop_early(self, key: OpKey) -> set[int]:
        """The peers that said READY for ``key`` before this rank submitted it."""
        early = self.early
        return (early.pop(key) or set()) if early.entries else set()

    def early_count(self) -> int:
        return len(self.early)
