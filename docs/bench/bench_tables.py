"""The rows of the tables ``python -m totalreduce.bench`` printed (docs/bench/<name>.txt),
by column name, so that the page's sentences quote the tables they stand beside and stay
true when the tables are regenerated."""

from __future__ import annotations

import functools
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

Row = dict[str, str]

_RULE = re.compile(r"\s*-+(\s+-+)*\s*")
_GAP = re.compile(r"\S(\s{2,})\S")


def _named(names: list[str]) -> list[str]:
    """``names`` with a repeated one numbered (a second "accuracy" is "accuracy 2")."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} {seen[name]}")
    return out


def _cut(line: str, starts: list[int]) -> list[str]:
    ends = [*starts[1:], len(line) + 1]
    return [line[a:b].strip() for a, b in zip(starts, ends, strict=True)]


@functools.cache
def rows(name: str) -> tuple[Row, ...]:
    """Every data row of NAME.txt, read once (the page asks each table many times; the
    rows are shared: do not change them).  A table whose header has a rule of dashes under it is
    cut at the rule's columns (a cell may hold single spaces: "allreduce 8 B"); one
    without, at runs of two or more spaces, its header being the first line that has
    such a run."""
    lines = [ln for ln in (HERE / f"{name}.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith(("environment:", "arrays:", "#"))]
    out: list[Row] = []
    header: list[str] | None = None
    starts: list[int] | None = None
    for i, line in enumerate(lines):
        ruled = i + 1 < len(lines) and _RULE.fullmatch(lines[i + 1]) is not None
        if ruled:
            starts = [m.start() for m in re.finditer(r"-+", lines[i + 1])]
            header = _named(_cut(line, starts))
            continue
        if _RULE.fullmatch(line):
            continue
        if starts is not None and header is not None:
            cells = _cut(line, starts)
        else:
            if _GAP.search(line.strip()) is None:
                continue  # a title line
            cells = re.split(r"\s{2,}", line.strip())
            if header is None:
                header = _named(cells)
                continue
        # A header may name one more column than its rows fill (hosts --train's
        # "(target 95%)" says what the two before it mean).
        if header is not None and 2 <= len(cells) <= len(header):
            out.append(dict(zip(header, cells, strict=False)))
    return tuple(out)


def find(name: str, **match: str) -> Row:
    """The one row of NAME.txt whose cells equal ``match`` (column names with spaces as
    underscores: ``find("latency", n="2", op="allreduce 8 B", backend="mpi")``).

    Raises:
        LookupError: no row, or more than one, matches.
    """
    want = {k.replace("_", " "): v for k, v in match.items()}
    hits = [r for r in rows(name) if all(r.get(k) == v for k, v in want.items())]
    if len(hits) != 1:
        raise LookupError(f"{name}.txt: {len(hits)} rows match {want}")
    return hits[0]


def num(cell: str) -> float:
    """The number a cell starts with: "1.23x", "97.00%", "55,164", "0.119 (1.00x)"."""
    m = re.match(r"-?[\d,]*\.?\d+", cell.strip())
    if m is None:
        raise ValueError(f"no number in {cell!r}")
    return float(m.group().replace(",", ""))


def span(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """"a-b" of the smallest and largest of ``values`` (one value if they are equal)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"
