"""Crash states from a RecordFS log (tests/power/recordfs.py): which of the
recorded operations a lost page cache keeps, and the file tree that leaves.

    durable_at()    - per operation, the first sync that makes it durable
    crash_states()  - sampled crash states: (crash point, operations kept)
    replay()        - the tree that a set of kept operations leaves
    materialise()   - that tree written into a fresh directory

Persistence models (``model``):

    posix    a file's fsync/fdatasync makes its earlier writes, truncates and
             mode changes durable; a directory's fsync makes the earlier
             entries made or removed in it durable (create, mkdir, link,
             unlink, rmdir; a rename once either of its directories is synced,
             a rename being one journal transaction). A file's fsync does not
             make its own name durable.
    journal  posix, plus any fsync commits every earlier name-space and mode
             change (ext4 and xfs commit one journal for the whole file system).

Everything synced before the crash point survives. Of the rest:

    prefix       the unsynced operations up to a cut, in order (ext4
                 ``data=ordered``-like)
    per-file     per file (a directory is a file of entries), its unsynced
                 operations kept up to a cut of its own, files independent
    independent  each unsynced operation kept or lost by a coin flip

An operation is one FUSE request: a write of up to the mount's max_write
bytes is kept or lost whole (torn writes inside one request are not modelled).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

NEVER = 1 << 62
_DATA = ("write", "trunc", "falloc", "chmod")
_ENTRY = ("create", "mkdir", "link", "unlink", "rename")


def owner(op: tuple) -> int | None:
    """The file whose cut an operation belongs to (per-file model)."""
    kind = op[0]
    if kind in _DATA:
        return op[1]
    if kind in ("create", "mkdir", "unlink"):
        return op[1]
    if kind == "link":
        return op[2]
    if kind == "rename":
        return op[3]
    return None


def durable_at(log: Sequence[tuple], model: str = "posix") -> list[int]:
    """Per operation, the index of the first sync that makes it durable
    (NEVER if none does; a sync or a mark is durable at itself)."""
    out = [NEVER] * len(log)
    data: dict[int, list[int]] = {}
    entries: dict[int, list[int]] = {}
    meta: list[int] = []
    for i, op in enumerate(log):
        kind = op[0]
        if kind in ("fsync", "mark"):
            out[i] = i
            if kind == "fsync":
                ident = op[1]
                for j in data.pop(ident, ()):
                    out[j] = min(out[j], i)
                for j in entries.pop(ident, ()):
                    out[j] = min(out[j], i)
                if model == "journal":
                    for j in meta:
                        out[j] = min(out[j], i)
                    meta = []
            continue
        if kind in _DATA:
            data.setdefault(op[1], []).append(i)
        if kind == "rename":
            entries.setdefault(op[1], []).append(i)
            entries.setdefault(op[3], []).append(i)
        elif kind in _ENTRY:
            entries.setdefault(owner(op), []).append(i)
        if kind != "write":
            meta.append(i)
    return out


@dataclass(frozen=True)
class CrashState:
    point: int  # operations [0, point) had been issued
    kept: frozenset[int]  # of those, what the disk holds
    how: str  # "prefix", "per-file", "independent"


def crash_points(log: Sequence[tuple], sampled: int, rng: random.Random) -> list[int]:
    """Right after every sync and every mark, at the end, and ``sampled``
    points between."""
    points = {i + 1 for i, op in enumerate(log) if op[0] in ("fsync", "mark")}
    points.add(len(log))
    points.update(rng.randrange(len(log) + 1) for _ in range(sampled))
    return sorted(points)


def crash_states(
    log: Sequence[tuple],
    model: str,
    *,
    per_point: int,
    sampled_points: int,
    seed: int = 0,
) -> Iterator[CrashState]:
    """Up to ``per_point`` states at each crash point in each way (prefix,
    per-file, independent), deduplicated by what they keep."""
    rng = random.Random(seed)
    dur = durable_at(log, model)
    seen: set[frozenset[int]] = set()
    for point in crash_points(log, sampled_points, rng):
        synced = [i for i in range(point) if dur[i] < point]
        loose = [
            i for i in range(point)
            if dur[i] >= point and log[i][0] not in ("fsync", "mark")
        ]  # fmt: skip
        base = frozenset(synced)
        candidates: list[tuple[str, frozenset[int]]] = []
        cuts = {0, len(loose)}
        cuts.update(rng.randint(0, len(loose)) for _ in range(per_point))
        candidates += [("prefix", base | frozenset(loose[:c])) for c in sorted(cuts)]
        groups: dict[int | None, list[int]] = {}
        for i in loose:
            groups.setdefault(owner(log[i]), []).append(i)
        for _ in range(per_point):
            kept = set(base)
            for ops in groups.values():
                kept.update(ops[: rng.randint(0, len(ops))])
            candidates.append(("per-file", frozenset(kept)))
        for _ in range(per_point):
            kept = set(base)
            kept.update(i for i in loose if rng.random() < 0.5)
            candidates.append(("independent", frozenset(kept)))
        for how, kept in candidates:
            if kept not in seen:
                seen.add(kept)
                yield CrashState(point, kept, how)


@dataclass
class Node:
    is_dir: bool
    mode: int
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)


def replay(log: Sequence[tuple], kept: frozenset[int] | None = None) -> dict[int, Node]:
    """The inodes that the kept operations (all, for None) leave; id 0 is the
    root. An operation whose file was never created (its create lost) still
    acts on that file: its name may be gone while its data is not."""
    nodes: dict[int, Node] = {0: Node(True, 0o700)}
    dirs = {op[3] for op in log if op[0] == "mkdir"}

    def node(ident: int, is_dir: bool = False) -> Node:
        found = nodes.get(ident)
        if found is None:
            is_dir = is_dir or ident in dirs
            found = nodes[ident] = Node(is_dir, 0o700 if is_dir else 0o600)
        return found

    for i, op in enumerate(log):
        if kept is not None and i not in kept:
            continue
        kind = op[0]
        if kind == "create":
            node(op[3]).mode = op[4]
            node(op[1], True).entries[op[2]] = op[3]
        elif kind == "mkdir":
            made = node(op[3], True)
            made.is_dir, made.mode = True, op[4]
            node(op[1], True).entries[op[2]] = op[3]
        elif kind == "write":
            data = node(op[1]).data
            end = op[2] + len(op[3])
            if len(data) < end:
                data.extend(bytes(end - len(data)))
            data[op[2] : end] = op[3]
        elif kind == "trunc":
            data = node(op[1]).data
            if len(data) > op[2]:
                del data[op[2] :]
            else:
                data.extend(bytes(op[2] - len(data)))
        elif kind == "falloc":
            data = node(op[1]).data
            if len(data) < op[2] + op[3]:
                data.extend(bytes(op[2] + op[3] - len(data)))
        elif kind == "chmod":
            node(op[1]).mode = op[2]
        elif kind == "link":
            node(op[1])
            node(op[2], True).entries[op[3]] = op[1]
        elif kind == "unlink":
            entries = node(op[1], True).entries
            if entries.get(op[2]) == op[3]:
                del entries[op[2]]
        elif kind == "rename":
            src = node(op[1], True).entries
            if src.get(op[2]) == op[5]:
                del src[op[2]]
            node(op[5])
            node(op[3], True).entries[op[4]] = op[5]
    return nodes


def materialise(nodes: dict[int, Node], root: str) -> None:
    """Write the tree under ``root`` (made here): files with their bytes and
    modes, a file under two names as a hard link, a directory reachable twice
    (a lost rmdir next to a kept mkdir) only once."""
    os.mkdir(root, 0o700)
    first_path: dict[int, str] = {0: root}

    def walk(ident: int, path: str) -> None:
        for name, child in sorted(nodes[ident].entries.items()):
            target = os.path.join(path, name)
            kid = nodes[child]
            if child in first_path:
                if not kid.is_dir:
                    os.link(first_path[child], target)
                continue
            first_path[child] = target
            if kid.is_dir:
                os.mkdir(target)
                walk(child, target)
                os.chmod(target, kid.mode)
            else:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, kid.mode)
                try:
                    os.write(fd, kid.data)
                finally:
                    os.close(fd)
                os.chmod(target, kid.mode)

    walk(0, root)
    os.chmod(root, nodes[0].mode)
