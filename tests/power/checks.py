"""The power-loss harness's check of one crash state (run in a fresh process
per state, tests/power/harness.py): what the workload's marks before the crash
point promise (tests/power/workload.py), and whether a fresh open keeps it.

    expectations() - from the marks: the chunks that must read back, those
                     that may be gone, the pinned ones, the evictions whose
                     removal must be in the removal log
    check_state()  - open a fresh KVStore on a materialised crash state,
                     as the first open of a new boot, and check it: a Verdict
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

from npukv_store import KVStore
from npukv_store.store import calibration, sessions
from npukv_store.store.pins import PinRecord, decode_pins
from tests.power.workload import SPEC, config, keys_for
from tests.support.blocks import empty_blocks, verify_read


@dataclass
class Verdict:
    lost: list[str] = field(default_factory=list)  # promised, not read back
    wrong: list[str] = field(default_factory=list)  # served with wrong bytes
    refused: str = ""  # the open (or a read, or check) raised
    problems: list[str] = field(default_factory=list)  # check(), pins, removal log


@dataclass(frozen=True)
class Expectations:
    kind: str  # the configuration's kind (workload.config)
    required: frozenset[str]  # put returned, no eviction of it had begun
    pinned: frozenset[str]  # pinned, its unpin not begun: present and pinned
    removed: frozenset[str]  # evicted by a put that returned: in the removal log


def _split(marks: Sequence[str], prefix: str) -> list[str]:
    return [m[len(prefix) :] for m in marks if m.startswith(prefix)]


def expectations(before: Sequence[str], every: Sequence[str]) -> Expectations:
    """What the marks recorded before the crash point (``before``) promise,
    given every mark of the log (``every``: which put evicted which chunk,
    known only after that put returned)."""
    kinds = set(_split(every, "config:"))
    assert len(kinds) <= 1, f"one configuration per workload, found {kinds}"
    begun = set(_split(before, "begin:"))
    returned = set(_split(before, "put:"))
    may_be_gone, removed = set(), set()
    for gone in _split(every, "gone:"):
        chunk, by = gone.split("@")
        if by in begun:  # the put that evicted it had started: it may be gone
            may_be_gone.add(chunk)
        if by in returned:
            removed.add(chunk)
    pinned = set(_split(before, "pinned:")) - set(_split(before, "unpin:"))
    return Expectations(
        kind=kinds.pop() if kinds else "put",
        required=frozenset((returned - may_be_gone) | pinned),
        pinned=frozenset(pinned),
        removed=frozenset(removed),
    )


def check_state(root: str, before: Sequence[str], every: Sequence[str]) -> Verdict:
    """Open ``root`` with a fresh KVStore, as the first open after a reboot
    (a new boot id: docs/decisions/0072): every required chunk reads back
    byte-exact, no block of any chunk the workload named reads back wrong,
    pins and the removal log keep their promises, and check() finds nothing:
    not even a crash's leftovers, which the first open of a boot sweeps."""
    expect = expectations(before, every)
    verdict = Verdict()
    sessions.boot_id = lambda: os.urandom(16).hex().encode()  # a fresh process's
    try:
        store = KVStore(config(root, expect.kind), SPEC)
    except Exception:
        verdict.refused = traceback.format_exc(limit=4)
        return verdict
    try:
        attempted = sorted({m.split(":", 1)[1] for m in every if m.startswith("put:")})
        for label in attempted:
            keys = keys_for(label)
            out = empty_blocks(SPEC, len(keys))
            hits = store.read(keys, out)
            bad = verify_read(SPEC, keys, out, hits)
            if bad:
                verdict.wrong.append(f"{label}: rows {bad}")
            if label in expect.required and not all(hits):
                verdict.lost.append(f"{label}: hits {hits}")
        verdict.problems = store.check()
        verdict.problems += _pin_problems(store, expect)
        verdict.problems += _removal_problems(store, expect)
        calibration.load(store.dir)  # never raises, whatever a crash left
    except Exception:
        verdict.refused = traceback.format_exc(limit=4)
    finally:
        store.close()
    return verdict


def _pin_problems(store: KVStore, expect: Expectations) -> list[str]:
    labels = {
        record.label
        for record in decode_pins(store.index.pin_records()).values()
        if isinstance(record, PinRecord)
    }
    return [f"pin of {label} missing" for label in expect.pinned - labels]


def _removal_problems(store: KVStore, expect: Expectations) -> list[str]:
    """A durable eviction's keys are in the removal log (KV events' source),
    unless the log says it lost entries."""
    if not expect.removed:
        return []
    log = store.removed_since(0, limit=1 << 16)
    if log.gap:
        return []
    logged = set(log.keys)
    return [
        f"eviction of {label} not in the removal log"
        for label in sorted(expect.removed)
        if not set(keys_for(label)) <= logged
    ]
