"""MooncakeTier against a real mooncake_master: write-through from a store's
ring, lookups and verified loads from another node, namespaces, corruption,
a full segment and a contributor that leaves.

Helpers: tests/support/remote.py; the ``nodes`` fixture: conftest.py.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from npukv_store import NamespaceSpec
from npukv_store.hashing import namespace_fingerprint
from npukv_store.remote.value import SUMS_OFFSET, ValueLayout, encode_value, remote_key
from tests.support.blocks import block_tensors, tiny_spec
from tests.support.remote import (
    assert_layers_equal,
    big_spec,
    block_layers,
    expected_values,
    join_closes,
    load_buffer,
    make_keys,
    put_through,
    wait_until,
)

# -- write-through and reads from another node -----------------------------------------


def test_write_through_reaches_another_node_byte_for_byte(nodes):
    spec = tiny_spec()
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    writer = nodes.tier()
    store = nodes.store(writer, spec)
    keys = make_keys("write-through", 40)
    for begin in range(0, 40, 10):
        batch = keys[begin : begin + 10]
        assert store.put_async(batch, block_tensors(spec, batch)).queued == 10
    assert store.flush(10.0)
    assert store.ring_used_bytes() == 0
    counts = writer.counters.snapshot()
    assert counts.get("remote_put_blocks") == 40, counts
    assert counts.get("remote_put_bytes") == 40 * layout.value_bytes, counts
    for bad in ("remote_put_full", "remote_put_failed", "remote_put_dropped"):
        assert counts.get(bad, 0) == 0, counts
    assert store.lookup(keys) == 40  # and the local store has them

    reader = nodes.tier(segment=0)
    unknown = make_keys("never-put", 1)
    assert reader.lookup(fingerprint, keys, 0.5) == 40
    assert reader.lookup(fingerprint, keys + unknown, 0.5) == 40
    assert reader.lookup(fingerprint, unknown + keys, 0.5) == 0
    assert reader.lookup(fingerprint, keys[:7] + unknown + keys[7:], 0.5) == 7
    out = load_buffer(reader, layout, 40)
    result = reader.fetch(fingerprint, layout, keys, out)
    assert result.ok == [True] * 40
    assert not result.abandoned
    assert_layers_equal(spec, out, keys, range(40))
    # the whole value too: prefix, the chunk's checksums, the rows
    assert np.array_equal(out, expected_values(spec, keys, writer.keys.mac_key))
    loads = reader.counters.snapshot()
    assert loads.get("remote_load_blocks") == 40, loads
    assert loads.get("remote_load_bytes") == 40 * layout.value_bytes, loads


def test_flush_leaves_no_ring_held_by_remote_puts(nodes):
    """Each flush returns only once the remote puts gave their regions back."""
    spec = big_spec()
    writer = nodes.tier()
    store = nodes.store(writer, spec)
    keys = make_keys("ring", 48)
    for begin in range(0, 48, 4):
        batch = keys[begin : begin + 4]
        store.put_async(batch, block_tensors(spec, batch))
        assert store.flush(10.0)
        assert store.ring_used_bytes() == 0, f"after the batch at {begin}"
    assert writer.counters.snapshot().get("remote_put_blocks") == 48


def test_drain_waits_for_the_release_of_every_put(nodes):
    """The ring region a put reads is given back before drain() returns (a
    flush, then close() unmapping the ring, relies on it)."""
    spec = tiny_spec()
    fingerprint = namespace_fingerprint(spec)
    tier = nodes.tier()
    values = expected_values(spec, make_keys("drain", 3), tier.keys.mac_key)
    tier.register(values.ctypes.data, values.nbytes)
    layout = ValueLayout.for_spec(spec)
    released: list[float] = []

    def release() -> None:
        time.sleep(0.05)  # a release that takes a moment (a lock, a GIL switch)
        released.append(time.monotonic())

    base = values.ctypes.data
    pieces = [
        [
            (
                base + i * layout.value_bytes + SUMS_OFFSET,
                layout.value_bytes - SUMS_OFFSET,
            )
        ]
        for i in range(3)
    ]
    assert tier.offer_blocks(spec, fingerprint, make_keys("drain", 3), pieces, release)
    assert tier.drain(5.0)
    assert released, "drain() returned while the put's region was still held"
    assert tier.counters.snapshot().get("remote_put_blocks") == 3


def fill_staged(staged, spec: NamespaceSpec, tensors) -> None:
    """Fill a begin_save region layer by layer, as the connector's copies do."""
    base = staged.image.ctypes.data
    for index, layer in enumerate(spec.layers):
        offset = staged.layer_address(index) - base
        for part in layer.parts:
            rows = tensors[f"{layer.name}.{part.name}"][staged.indices]
            data = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
            staged.image[offset : offset + data.size] = data
            offset += data.size


def test_begin_save_writes_through_unless_told_not_to(nodes):
    """Blocks loaded from the tier are saved with to_remote=False: stored
    locally, never put back; the others are put like put_async's."""
    spec = tiny_spec()
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    tier = nodes.tier()
    store = nodes.store(tier, spec)
    came_back, fresh = make_keys("from-remote", 6), make_keys("fresh", 6)
    for keys, to_remote in ((came_back, False), (fresh, True)):
        staged = store.begin_save(keys, to_remote=to_remote)
        assert staged is not None
        fill_staged(staged, spec, block_tensors(spec, keys))
        store.commit_save(staged)
    assert store.flush(10.0)
    assert store.ring_used_bytes() == 0
    assert store.lookup(came_back) == 6
    assert store.lookup(fresh) == 6
    counts = tier.counters.snapshot()
    assert counts.get("remote_put_blocks") == 6, counts
    assert counts.get("remote_put_dropped", 0) == 0, counts
    assert tier.lookup(fingerprint, came_back, 0.5) == 0
    assert tier.lookup(fingerprint, fresh, 0.5) == 6
    out = load_buffer(tier, layout, 6)
    assert tier.fetch(fingerprint, layout, fresh, out).ok == [True] * 6
    assert np.array_equal(out, expected_values(spec, fresh, tier.keys.mac_key))


class GatedProbes:
    """A tier's real client whose batch_is_exist first waits for ``gate``
    (60 s at most: a generous deadline to fail by); ``inside``: probes held
    at the gate now, ``probes``: probes sent."""

    def __init__(self, client) -> None:
        self._client = client
        self.gate = threading.Event()
        self.inside = 0
        self.probes = 0

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def batch_is_exist(self, names):
        self.probes += 1
        self.inside += 1
        try:
            self.gate.wait(60.0)
        finally:
            self.inside -= 1
        return self._client.batch_is_exist(names)


def test_lookup_waits_no_longer_than_asked(nodes):
    """lookup(wait_s=0) never waits for the master: it answers None while
    its probe is held in the client, the count once the probe is back, 0
    for a chain found absent, and a chain seen present from its cache,
    sending nothing, even while a probe would be held."""
    spec = tiny_spec()
    fingerprint = namespace_fingerprint(spec)
    writer = nodes.tier()
    put_through(nodes.store(writer, spec), make_keys("wait", 8))
    keys = make_keys("wait", 8)
    reader = nodes.tier(segment=0)
    reader._client = client = GatedProbes(reader._client)
    assert reader.lookup(fingerprint, keys, 0.0) is None, "it waited for its probe"
    assert wait_until(lambda: client.inside == 1, 10.0)  # the probe, held
    for _ in range(5):
        assert reader.lookup(fingerprint, keys, 0.0) is None
        assert client.inside == 1, "lookup(wait_s=0) waited for its probe"
    assert client.probes == 1
    client.gate.set()
    answers = []
    for _ in range(1000):  # 10 s at most
        answers.append(reader.lookup(fingerprint, keys, 0.0))
        if answers[-1] is not None:
            break
        time.sleep(0.01)
    assert answers[-1] == 8, answers
    assert set(answers[:-1]) <= {None}, answers
    # an unknown chain is answered 0 once its probe is back, and a chain
    # seen present is answered from the cache with no probe sent
    unknown = make_keys("wait-unknown", 4)
    first = reader.lookup(fingerprint, unknown, 0.0)
    assert first in (None, 0)
    assert reader.lookup(fingerprint, unknown, 0.5) == 0
    client.gate.clear()  # a probe now would be held: None
    sent = client.probes
    assert reader.lookup(fingerprint, keys, 0.0) == 8
    assert client.probes == sent
    client.gate.set()


# -- namespaces ------------------------------------------------------------------------


def test_two_namespaces_on_one_master_never_meet(nodes):
    spec_a, spec_b = tiny_spec(model="model-a"), tiny_spec(model="model-b")
    layout = ValueLayout.for_spec(spec_a)
    assert ValueLayout.for_spec(spec_b) == layout  # same shapes: only names differ
    fp_a, fp_b = namespace_fingerprint(spec_a), namespace_fingerprint(spec_b)
    tier = nodes.tier()
    # one tier, two namespaces (on two cache dirs: a store takes a block key
    # as its own whatever the namespace, as real keys are namespace-seeded)
    store_a = nodes.store(tier, spec_a)
    store_b = nodes.store(tier, spec_b, cache_dir=nodes.tmp_path / "other")
    only_a, only_b, both = make_keys("a", 12), make_keys("b", 12), make_keys("ab", 6)
    put_through(store_a, only_a + both)
    put_through(store_b, only_b + both)
    assert tier.counters.snapshot().get("remote_put_blocks") == 36
    reader = nodes.tier(segment=0)
    assert reader.lookup(fp_a, only_a + both, 0.5) == 18
    assert reader.lookup(fp_b, only_b + both, 0.5) == 18
    assert reader.lookup(fp_b, only_a, 0.5) == 0
    assert reader.lookup(fp_a, only_b, 0.5) == 0
    out = load_buffer(reader, layout, 18)
    assert reader.fetch(fp_b, layout, only_a, out[:12]).ok == [False] * 12
    assert reader.fetch(fp_a, layout, only_b, out[:12]).ok == [False] * 12
    for spec, fp, keys in ((spec_a, fp_a, only_a), (spec_b, fp_b, only_b)):
        assert reader.fetch(fp, layout, keys + both, out).ok == [True] * 18
        assert np.array_equal(
            out, expected_values(spec, keys + both, reader.keys.mac_key)
        )
    counts = reader.counters.snapshot()
    assert counts.get("remote_load_corrupt", 0) == 0, counts  # misses, not reads
    assert counts.get("remote_load_missing") == 24, counts


# -- corruption ------------------------------------------------------------------------


def test_corrupt_values_are_refused_one_by_one(nodes, caplog):
    """Each refused, counted; one WARNING per kind (a failed MAC, any other
    mismatch) until a load verifies again, each value's reason at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="npukv_store.remote.transfers")
    spec = tiny_spec()
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    other_fp = namespace_fingerprint(tiny_spec(model="someone-else"))
    tier = nodes.tier()
    keys = make_keys("corrupt", 10)
    put_through(nodes.store(tier, spec), keys)
    good = expected_values(spec, keys, tier.keys.mac_key)
    client = tier._client  # the raw Mooncake client, to overwrite values

    def overwrite(index: int, value: bytes) -> None:
        name = remote_key(fingerprint, keys[index], tier.keys.name_key)
        assert client.upsert(name, value) == 0

    rng = np.random.default_rng(7)
    overwrite(1, rng.integers(0, 256, layout.value_bytes, np.uint8).tobytes())
    # a valid value, of another block: only the key in its prefix tells
    overwrite(3, good[5].tobytes())
    # a valid value of the same block, of another namespace
    overwrite(4, encode_value(layout, other_fp, keys[4], block_layers(
        spec, block_tensors(spec, keys), 4
    ), mac_key=tier.keys.mac_key))  # fmt: skip
    # one flipped bit in a layer's data
    flipped = good[6].copy()
    flipped[layout.layer_offset(2) + 17] ^= 0x10
    overwrite(6, flipped.tobytes())
    overwrite(7, good[7][:100].tobytes())  # short
    overwrite(8, good[8].tobytes() + b"tail")  # long: does not fit the buffer
    out = load_buffer(tier, layout, 10)
    result = tier.fetch(fingerprint, layout, keys, out)
    bad = {1, 3, 4, 6, 7, 8}
    assert result.ok == [i not in bad for i in range(10)]
    assert not result.abandoned
    for i in set(range(10)) - bad:
        assert np.array_equal(out[i], good[i])
    counts = tier.counters.snapshot()
    assert counts.get("remote_load_corrupt") == 5, counts  # 1, 3, 4, 6, 7
    assert counts.get("remote_load_errors") == 1, counts  # 8: Mooncake refused it
    assert counts.get("remote_load_blocks") == 4, counts
    assert counts.get("remote_load_missing", 0) == 0, counts
    assert tier.up  # corruption is not an outage
    assert counts.get("remote_load_mac_failed") == 1, counts  # 1: random bytes
    warned = [r.getMessage() for r in warnings(caplog)]
    assert len([w for w in warned if "fails its MAC" in w]) == 1, warned
    assert len([w for w in warned if "is not the block" in w]) == 1, warned
    said = [r.getMessage() for r in caplog.records if r.name.endswith("transfers")]
    assert len(said) == 5, said
    assert any(f"key {keys[5].hex()}, expected {keys[3].hex()}" in s for s in said)
    assert any("namespace" in s for s in said)
    assert any("layer 2 checksum" in s for s in said)
    assert any("MAC mismatch" in s for s in said)
    # again: no more warnings while values keep failing; a good load resets
    tier.fetch(fingerprint, layout, keys, out)
    assert len(warnings(caplog)) == 2
    good_keys = [keys[i] for i in sorted(set(range(10)) - bad)]
    assert all(tier.fetch(fingerprint, layout, good_keys, out[:4]).ok)
    tier.fetch(fingerprint, layout, keys, out)
    assert len(warnings(caplog)) == 4


def warnings(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name.endswith("transfers") and r.levelno == logging.WARNING
    ]


# -- a full segment --------------------------------------------------------------------


def test_full_segment_drops_remote_puts_but_keeps_local_blocks(nodes):
    spec = big_spec()
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    # the only segment, and Mooncake's smallest (16 MiB): 127 values of 128 KiB
    tier = nodes.tier(segment=16 << 20)
    store = nodes.store(tier, spec)
    keys = make_keys("full", 192)
    put_through(store, keys, batch=32)
    assert store.ring_used_bytes() == 0
    counts = tier.counters.snapshot()
    stored, full = counts.get("remote_put_blocks", 0), counts.get("remote_put_full", 0)
    assert full > 0, counts
    assert 0 < stored < 192, counts
    assert stored + full + counts.get("remote_put_failed", 0) == 192, counts
    assert counts.get("remote_put_dropped", 0) == 0, counts
    assert store.lookup(keys) == 192  # every block is still stored locally
    assert tier.up  # a full pool is not a dead master
    # what is still there reads back right; the rest is a miss, not an error
    # (a full pool evicts: Mooncake dropped the oldest tenth of the values
    # here, so fewer than the stored ones remain)
    out = load_buffer(tier, layout, 192)
    result = tier.fetch(fingerprint, layout, keys, out)
    assert 0 < sum(result.ok) <= stored
    rows = [i for i, ok in enumerate(result.ok) if ok]
    want = expected_values(spec, [keys[i] for i in rows], tier.keys.mac_key)
    assert np.array_equal(out[rows], want)
    loads = tier.counters.snapshot()
    assert loads.get("remote_load_missing") == 192 - len(rows), loads
    assert loads.get("remote_load_errors", 0) == 0, loads


# -- a contributor that leaves ---------------------------------------------------------


def test_values_go_with_the_contributor_that_closes(nodes):
    spec = tiny_spec()
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    contributor = nodes.tier()
    store = nodes.store(contributor, spec)
    keys = make_keys("leaves", 20)
    put_through(store, keys)
    reader = nodes.tier(segment=0)
    assert reader.lookup(fingerprint, keys, 0.5) == 20
    store.close()
    nodes.stores.remove(store)
    contributor.close()
    join_closes(5.0)  # its segment is unmounted when its client has closed
    out = load_buffer(reader, layout, 20)
    result = reader.fetch(fingerprint, layout, keys, out)
    assert result.ok == [False] * 20
    counts = reader.counters.snapshot()
    lost = counts.get("remote_load_missing", 0) + counts.get("remote_load_errors", 0)
    assert lost == 20, counts
    assert counts.get("remote_load_blocks", 0) == 0, counts
    assert reader.lookup(fingerprint, make_keys("after", 2), 0.5) == 0
