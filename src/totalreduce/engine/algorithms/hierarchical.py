"""Hierarchical allreduce: reduce within each host, across hosts, then share within it.

With ``H`` hosts of ``L`` ranks each, the buffer is cut into ``L`` blocks, one per local
rank, and each block into ``H`` sub-blocks:

1. a ring reduce-scatter among the host's ranks (shared memory) leaves local rank ``l``
   with the host's sum of block ``l``;
2. the ``l``-th ranks of all hosts run a ring allreduce of block ``l`` across hosts, so
   the host's ``L`` ranks drive ``L`` network streams at once, each carrying ``1/L`` of
   the buffer;
3. a ring allgather among the host's ranks gives every rank every finished block.

Each host sends and receives ``2 (H - 1) / H`` of the buffer over the network, as a flat
ring's slowest link does for each of its ranks: the flat ring puts ``2 (n - 1) / n`` of
the buffer through every link, and its cross-host links carry it once per rank pair that
straddles hosts.

The three stages are not run one after another: pieces flow through them as soon as
their inputs are in.  A piece of the cross-host stage that arrives before this host's
sum of its region is complete waits for it (``Recv.wait``), so what it unlocks carries
every local contribution.  Every finished region comes from one owner's reduction and is
copied everywhere else, so all ranks end bit-identical.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import COPY, REDUCE, Recv, Schedule, Send, even_bounds, piece_count, pieces


def host_groups(hosts: tuple[int, ...]) -> list[list[int]] | None:
    """The ranks of each host (hosts in number order, ranks ascending), or None where the
    layout does not suit: a single host, one rank per host, or hosts of unequal size."""
    groups: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    out = [groups[h] for h in sorted(groups)]
    if len(out) < 2 or len(out[0]) < 2 or any(len(g) != len(out[0]) for g in out):
        return None
    return out


@lru_cache(maxsize=256)
def hierarchical_allreduce(rank: int, hosts: tuple[int, ...], count: int,
                           seg_elems: int) -> Schedule:
    groups = host_groups(hosts)
    if groups is None:
        raise ValueError(f"no hierarchical layout for hosts {hosts}")
    n_hosts, n_local = len(groups), len(groups[0])
    h = hosts[rank]
    local = groups[h]
    me = local.index(rank)
    cross = [g[me] for g in groups]
    l_right, l_left = local[(me + 1) % n_local], local[(me - 1) % n_local]
    c_right, c_left = cross[(h + 1) % n_hosts], cross[(h - 1) % n_hosts]

    # Block b's piece j = x * m + q is piece q of its sub-block x: the stages share one
    # cut, so every message of a region covers the same elements in all three.
    blocks = even_bounds(count, n_local)
    subs = [even_bounds(blocks[b + 1] - blocks[b], n_hosts) for b in range(n_local)]
    m = piece_count(max(s[x + 1] - s[x] for s in subs for x in range(n_hosts)), seg_elems)
    cut = [[p for x in range(n_hosts)
            for p in pieces(blocks[b] + subs[b][x], blocks[b] + subs[b][x + 1], m)]
           for b in range(n_local)]
    n_pieces = n_hosts * m
    cross0 = n_local - 1                 # first step of the cross-host stage
    share0 = cross0 + 2 * (n_hosts - 1)  # first step of the sharing stage
    last_local = n_local - 2             # the local step that completes our own block

    def local_send(s: int, j: int) -> Send:  # reduce-scatter step s: block me - s - 1
        lo, hi = cut[(me - s - 1) % n_local][j]
        return Send(l_right, s, j, lo, hi)

    def cross_send(t: int, x: int, q: int) -> Send:
        j = x * m + q
        lo, hi = cut[me][j]
        return Send(c_right, cross0 + t, j, lo, hi)

    def share_send(u: int, j: int) -> Send:  # allgather step u: block me - u
        lo, hi = cut[(me - u) % n_local][j]
        return Send(l_right, share0 + u, j, lo, hi)

    recvs: dict[tuple[int, int, int], Recv] = {}
    for s in range(n_local - 1):
        b = (me - s - 2) % n_local
        for j in range(n_pieces):
            lo, hi = cut[b][j]
            if s < last_local:
                then: tuple[Send, ...] = (local_send(s + 1, j),)
            else:  # our block: its sub-block h opens the cross-host ring
                x, q = divmod(j, m)
                then = (cross_send(0, x, q),) if x == h else ()
            recvs[(l_left, s, j)] = Recv(lo, hi, REDUCE, False, then)

    reduce_steps = n_hosts - 1
    for t in range(2 * reduce_steps):
        reducing = t < reduce_steps
        x = (h - t - 1) % n_hosts if reducing else (h - (t - reduce_steps)) % n_hosts
        for q in range(m):
            j = x * m + q
            lo, hi = cut[me][j]
            then = (cross_send(t + 1, x, q),) if t + 1 < 2 * reduce_steps else ()
            finished = t >= reduce_steps - 1  # the owner's last reduction, or a copy
            if finished:
                then = (*then, share_send(0, j))
            recvs[(c_left, cross0 + t, j)] = Recv(
                lo, hi, REDUCE if reducing else COPY, reducing and finished, then,
                wait=((l_left, last_local, j),) if reducing else ())

    for u in range(n_local - 1):
        b = (me - u - 1) % n_local
        for j in range(n_pieces):
            lo, hi = cut[b][j]
            then = (share_send(u + 1, j),) if u + 1 < n_local - 1 else ()
            recvs[(l_left, share0 + u, j)] = Recv(lo, hi, COPY, False, then)

    return Schedule(tuple(local_send(0, j) for j in range(n_pieces)), recvs, ())
