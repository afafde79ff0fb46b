"""A hypothesis state machine over admission and eviction in a real store
(issue 39): requests walk chains of a random tree of blocks, as vLLM's
connector serves them (lookup, verified read of the hit, save of the rest
with its parent), and after every step the directory is prefix-closed,
within capacity, within its write budget, and its admission memory is
bounded and consistent."""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from npukv_store import KVStore
from npukv_store.config import StoreConfig
from npukv_store.store.admission import AdmissionTuning
from tests.support.block_tree import BlockTree, key

ROW = 1024  # a 2 KiB block: the capacity holds 12, fewer than the tree
TREE = BlockTree(48, seed=7, row=ROW, bushy=1)
SPEC = TREE.spec
NODES = 48
TUNING = AdmissionTuning(shadow_blocks=6, ghost_per_block=0.5, ghost_max=12)


class AdmissionMachine(RuleBasedStateMachine):
    policy = "auto"
    budget = 0

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="adm-machine-")
        self.capacity = 24 << 10
        self.config = StoreConfig(
            cache_dir=self.root, capacity=self.capacity, fsync="never",
            evict_grace_s=0, admission=self.policy, write_budget=self.budget,
        )  # fmt: skip
        # small tables, so that the bounds are reached: 6 sampled blocks per
        # shadow (half of the keys), shadow ghosts of 3, a ghost of at most 12
        self.store = KVStore(self.config, SPEC, admission_tuning=TUNING)
        self.start_ns = time.time_ns()
        self.largest_chunk = 0

    def teardown(self) -> None:
        self.store.close()

    @rule(node=st.integers(0, NODES - 1))
    def request(self, node: int) -> None:
        blocks = TREE.chain(node)
        keys = [key(b) for b in blocks]
        hit = self.store.lookup(keys)
        if hit:
            out = {n: np.zeros((hit, ROW), np.uint8) for n in ("l.k", "l.v")}
            ok = self.store.read(keys[:hit], out)
            want = TREE.rows(blocks[:hit])
            for i, good in enumerate(ok):
                if good:  # a miss is allowed (evicted since); wrong bytes never
                    assert all(np.array_equal(out[n][i], want[n][i]) for n in out)
            hit = ok.index(False) if False in ok else hit
        if hit < len(keys):
            before = self.store.counters.snapshot()["put_bytes"]
            self.store.put(
                keys[hit:],
                TREE.rows(blocks[hit:]),
                parent=keys[hit - 1] if hit else None,
            )
            wrote = self.store.counters.snapshot()["put_bytes"] - before
            self.largest_chunk = max(self.largest_chunk, wrote)

    @rule()
    def flush(self) -> None:
        self.store.flush_touches()

    @invariant()
    def prefix_closed(self) -> None:
        stored = {
            b for b in range(NODES) if self.store.index.locate([key(b)])[0] is not None
        }
        stranded = [
            b for b in stored if TREE.parent[b] >= 0 and TREE.parent[b] not in stored
        ]
        assert not stranded, f"blocks stored without their parent: {stranded}"

    @invariant()
    def within_capacity(self) -> None:
        assert self.store.stats().total_bytes <= self.capacity

    @invariant()
    def within_budget(self) -> None:
        admitter = self.store.admitter
        if not admitter.rate:
            return
        elapsed = (time.time_ns() - self.start_ns) / 1e9
        written = self.store.counters.snapshot()["put_bytes"]
        limit = admitter.bucket_size + admitter.rate * elapsed + self.largest_chunk
        assert written <= limit

    @invariant()
    def admission_memory_bounded_and_consistent(self) -> None:
        index = self.store.index
        assert index.admission_problems() == []
        tables = index.admission_report()["tables"]
        admitter = self.store.admitter
        shadow = admitter.shadow
        shadow_ghost = int(admitter.shadow_blocks * admitter.tuning.ghost_per_block)
        assert tables["ghost"] <= admitter.ghost_limit
        assert tables["processes"] <= 1
        assert len(shadow.every) <= admitter.shadow_blocks
        assert len(shadow.second) <= admitter.shadow_blocks
        assert len(shadow.ghost) <= max(1, shadow_ghost)


def _machine(policy: str, budget: int) -> type[AdmissionMachine]:
    return type(
        f"Machine_{policy}_{budget}", (AdmissionMachine,),
        {"policy": policy, "budget": budget},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "budget"),
    [("auto", 0), ("second_sight", 0), ("all", 0), ("auto", 480 << 10)],
)
def test_admission_machine(policy: str, budget: int) -> None:
    machine = _machine(policy, budget)
    machine.TestCase.settings = settings(
        max_examples=12, stateful_step_count=40, deadline=None
    )
    machine.TestCase().runTest()
