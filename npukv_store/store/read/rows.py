"""The rows of one chunk read, and their runs, worked out once per chunk.

Runs in: any process that reads; pure.

    ChunkRows  - the ``(key index, chunk row)`` items of a read, with
                 ``runs`` (key index and row both up by one) and ``row_runs``
                 (rows up by one, key index up or down by one)
"""

from __future__ import annotations

Item = tuple[int, int]  # (key index, chunk row)


class ChunkRows:
    """The items of one chunk read with their runs, worked out once per chunk:
    planned again for every layer and tensor, they took a tenth of a warm
    read's time (decision 0020)."""

    __slots__ = ("items", "runs", "row_runs")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.runs = _runs(items)
        self.row_runs = _row_runs(items)


def _row_runs(items: list[Item]) -> list[tuple[int, int, int, int]]:
    """``(key index of the first row, first row, count, step)`` of maximal runs
    of consecutive rows whose key index goes up (step 1) or down (step -1) by
    one per row: a run going down is one range of the file whose keys' rows
    sit in memory in reverse order (vLLM's descending block ids)."""
    runs: list[list[int]] = []
    for i, row in sorted(items, key=lambda item: item[1]):
        last = runs[-1] if runs else None
        if last and row == last[1] + last[2]:
            step = i - (last[0] + last[3] * (last[2] - 1))
            if step in (1, -1) and (last[2] == 1 or step == last[3]):
                last[2] += 1
                last[3] = step
                continue
        runs.append([i, row, 1, 1])
    return [(first, row, count, step) for first, row, count, step in runs]


def _runs(items: list[Item]) -> list[tuple[int, int, int]]:
    """``(first key index, first row, count)`` of maximal runs in which both the
    key index and the row go up by one."""
    runs: list[list[int]] = []
    for i, row in sorted(items, key=lambda item: item[1]):
        last = runs[-1] if runs else None
        if last and i == last[0] + last[2] and row == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([i, row, 1])
    return [(first, row, count) for first, row, count in runs]
