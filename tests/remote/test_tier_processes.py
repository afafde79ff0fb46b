"""Several processes writing through to one master, two of them SIGKILLed in
the middle of their puts: whatever the parent then loads either verifies as
exactly the bytes its writer put, or is a miss. Never a wrong block, never an
exception, and a load whose call outlives its deadline is abandoned.

The children are this module run as a script (``python -m
tests.remote.test_tier_processes CHILD-JSON``): each opens a tier and a store
on its own cache_dir, writes batches of blocks through, and reports each
flushed batch on stdout as a JSON line. Block contents derive from the key
(block_tensors), so the parent knows what every key must hold.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from npukv_store import KVStore
from npukv_store.hashing import namespace_fingerprint
from npukv_store.remote.tier import MooncakeTier
from npukv_store.remote.value import ValueLayout
from tests.support.remote import (
    attach,
    big_spec,
    block_tensors,
    expected_values,
    join_closes,
    load_buffer,
    make_keys,
    tier_config,
    wait_up,
)

REPO = Path(__file__).resolve().parents[2]
SPEC = big_spec(num_layers=1)  # 32 KiB blocks
FP = namespace_fingerprint(SPEC)
LAYOUT = ValueLayout.for_spec(SPEC)
PER_BATCH = 8


def batch_keys(name: str, batch: int) -> list[bytes]:
    return make_keys(f"{name}/{batch}", PER_BATCH)


# -- the child -------------------------------------------------------------------------


def say(**message) -> None:
    print(json.dumps(message), flush=True)


def child_main(args: dict) -> None:
    config = tier_config(
        args["master"], args["cache_dir"], args["segment"], fsync="never"
    )
    tier = wait_up(MooncakeTier(config))
    store = KVStore(config, SPEC)
    attach(store, tier)
    say(up=True)
    for batch in range(args["batches"]):
        keys = batch_keys(args["name"], batch)
        result = store.put_async(keys, block_tensors(SPEC, keys))
        store.flush(10.0)
        say(batch=batch, queued=result.queued, counters=tier.counters.snapshot())
        time.sleep(args["pause"])
    say(done=True, counters=tier.counters.snapshot())
    sys.stdin.read()  # until the parent is done reading our segment
    store.close()
    os._exit(0)  # not tier.close(): Mooncake's close holds the GIL 1-2 s


# -- the parent ------------------------------------------------------------------------


class Child:
    def __init__(self, tmp: Path, master: str, name: str, segment: int, **kw) -> None:
        self.name = name
        args = {
            "master": master, "cache_dir": str(tmp / name), "segment": segment,
            "name": name, "batches": kw.get("batches", 12),
            "pause": kw.get("pause", 0.0),
        }  # fmt: skip
        self.batches = args["batches"]
        self.log = tmp / f"{name}.stderr"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __spec__.name, json.dumps(args)],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.flushed = -1  # the last batch reported flushed
        self.done = False
        self.up = False
        self.last: dict = {}
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self._lines.put(line)

    def poll(self) -> None:
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return
            message = json.loads(line)
            self.last = message
            self.up = self.up or message.get("up", False)
            self.done = self.done or message.get("done", False)
            if "batch" in message:
                assert message["queued"] == PER_BATCH, message
                self.flushed = message["batch"]

    def wait(self, what, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while True:
            self.poll()
            if what(self):
                return
            code = self.proc.poll()
            assert code is None, f"{self.name} exited {code}: {self.stderr_tail()}"
            assert time.monotonic() < end, f"{self.name}: {self.stderr_tail()}"
            time.sleep(0.005)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.poll()

    def attempted(self) -> list[bytes]:
        """Every key this child put or may have been putting."""
        return [key for b in range(self.batches) for key in batch_keys(self.name, b)]

    def stderr_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-30:] if not line.startswith("I"))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()  # a survivor exits on EOF
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Loader:
    """The parent's loads: each one verified row exactly the block its
    writer put; never a buffer reused after an abandoned load. A load that
    outlives its deadline comes back abandoned, its call left pending
    (tests/remote/test_tier_faults.py checks that with a call that hangs);
    no wall-clock bound is asserted here: the deadline bounds the wait for
    Mooncake, not the verification after it, nor a loaded machine."""

    def __init__(self, tier: MooncakeTier) -> None:
        self.tier = tier
        self.kept: list[np.ndarray] = []  # abandoned buffers Mooncake may fill
        self.out = load_buffer(tier, LAYOUT, 64)
        self.abandoned = 0

    def load(self, keys: list[bytes]) -> list[bool]:
        ok: list[bool] = []
        for begin in range(0, len(keys), 64):
            part = keys[begin : begin + 64]
            out = self.out[: len(part)]
            result = self.tier.fetch(FP, LAYOUT, part, out)  # never raises
            assert len(result.ok) == len(part)
            if result.abandoned:  # given up on at its deadline, not waited for
                assert result.pending is not None
                assert not any(result.ok)
                self.abandoned += 1
                self.kept.append(self.out)
                self.out = load_buffer(self.tier, LAYOUT, 64)
            rows = [i for i, good in enumerate(result.ok) if good]
            if rows:
                want = expected_values(
                    SPEC, [part[i] for i in rows], self.tier.keys.mac_key
                )
                assert np.array_equal(out[rows], want), "a verified wrong value"
            ok += result.ok
        return ok


def test_kill_9_writers_never_yield_a_wrong_block(mooncake_master, tmp_path):
    master = mooncake_master.address
    # the parent contributes a segment, and so do s1 and v1; s2 and v0 do not
    parent_tier = MooncakeTier(tier_config(master, tmp_path / "parent", 32 << 20))
    children: list[Child] = []
    parent_store = None
    try:
        wait_up(parent_tier)
        for name, segment, kw in (
            ("s1", 32 << 20, {}),
            ("s2", 0, {}),
            ("v0", 0, {"batches": 100, "pause": 0.002}),
            ("v1", 32 << 20, {"batches": 100, "pause": 0.02}),
        ):  # one by one: the finally stops every child started so far
            children.append(Child(tmp_path, master, name, segment, **kw))
        s1, s2, v0, v1 = children
        for child in children:
            child.wait(lambda c: c.up, 30.0)
        s1.wait(lambda c: c.done)
        s2.wait(lambda c: c.done)
        v1.wait(lambda c: c.flushed >= 2)
        v0.wait(lambda c: c.flushed >= 3)
        v0.kill()  # a writer without a segment, in the middle of its puts
        assert not v0.done, "v0 finished before it was killed"
        loader = Loader(parent_tier)

        # 1: the survivors' blocks are all there; v0's are right or missing,
        # and every batch it reported flushed is there
        for child in (s1, s2):
            assert all(loader.load(child.attempted())), child.name
        ok = loader.load(v0.attempted())
        flushed = (v0.flushed + 1) * PER_BATCH
        assert all(ok[:flushed]), f"v0 flushed {v0.flushed + 1} batches"
        assert not all(ok), "v0 cannot have put everything"

        # 2: a writer that contributes a segment dies mid-puts: the blocks
        # in its segment are lost (Mooncake spreads values over segments,
        # so some of everyone's), the rest stay right; loads stay in time
        v1.poll()
        assert not v1.done
        v1.kill()
        killed = time.monotonic()
        everyone = [c.attempted() for c in children]
        previous: list[list[bool]] | None = None
        while True:
            abandoned = loader.abandoned
            results = [loader.load(keys) for keys in everyone]
            settled = (
                time.monotonic() - killed > 4.0  # the master's client_ttl: 3 s
                and parent_tier.up
                and loader.abandoned == abandoned
                and results == previous
            )
            if settled:
                break
            # a generous deadline to fail by, not a speed: settling takes ~5 s
            assert time.monotonic() - killed < 60.0, "the loads never settled"
            previous = results
            time.sleep(0.2)
        s1_ok, s2_ok, v0_ok, v1_ok = results
        kept = sum(s1_ok) + sum(s2_ok)
        assert 0 < kept <= len(s1_ok) + len(s2_ok)
        print(
            f"after v1's death: {kept} of {len(s1_ok) + len(s2_ok)} survivor "
            f"blocks left, {loader.abandoned} loads abandoned"
        )

        # 3: the parent's own store still works, locally and through the tier
        parent_store = KVStore(parent_tier.config, SPEC)
        attach(parent_store, parent_tier)
        mine = make_keys("parent", 16)
        before = parent_tier.counters.snapshot().get("remote_put_blocks", 0)
        assert parent_store.put_async(mine, block_tensors(SPEC, mine)).queued == 16
        assert parent_store.flush(10.0)
        assert parent_store.lookup(mine) == 16
        out = {
            name: np.zeros_like(value)
            for name, value in block_tensors(SPEC, mine).items()
        }
        assert parent_store.read(mine, out) == [True] * 16
        for name, value in block_tensors(SPEC, mine).items():
            assert np.array_equal(out[name], value)
        assert parent_tier.counters.snapshot()["remote_put_blocks"] == before + 16
        assert all(loader.load(mine))
        assert parent_store.ring_used_bytes() == 0
    finally:
        for child in children:
            child.stop()
        if parent_store is not None:
            parent_store.close()
        parent_tier.close()
        join_closes(5.0)


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
