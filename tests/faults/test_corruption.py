"""Corrupt chunk files: bit flips, garbled headers, truncation, zeros, files of
other chunks or other namespaces. Never served; other chunks still hit.

Each trial damages one chunk of a fresh directory of three, then reads every
block in one call from a fresh handle, alternately through the page cache (the
native cached path) and with it dropped (the I/O engine path). The damaged
chunk's blocks are exempt from the durability count (the fault destroys that
file by design); every other block must read back. (fsync is off: power
loss is not the fault here, and the files are complete before the damage.)
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import struct
from collections.abc import Callable

import pytest

from npukv_store import KVStore
from tests.support import faults
from tests.support.faults import BIG, BLOCKS, config, drop_page_cache, fill

#: damage(path, rng) -> the rows (blocks) of the chunk that must miss, or None
#: when the whole chunk must miss, or "any" when the outcome may go either way
Damage = Callable[[str, random.Random], "set[int] | None | str"]


def _flip_data(path: str, rng: random.Random) -> set[int]:
    start = faults.data_start(path)
    rel = rng.randrange(BLOCKS * BIG.block_bytes)
    faults.flip_bit(path, start + rel, rng.randrange(8))
    return {faults.block_at(BIG, BLOCKS, rel)}


def _flip_table(path: str, rng: random.Random) -> set[int]:
    entry = rng.randrange(BLOCKS * len(BIG.layers))
    offset = faults.table_offset(path, BIG, BLOCKS) + 8 * entry
    faults.flip_bit(path, offset + rng.randrange(8), rng.randrange(8))
    return {entry // len(BIG.layers)}


def _flip_header(path: str, rng: random.Random) -> str:
    end = faults.data_start(path)
    faults.flip_bit(path, rng.randrange(8, end), rng.randrange(8))
    return "any"


def _not_json(path: str, rng: random.Random) -> None:
    end = faults.data_start(path)
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(bytes(rng.randrange(256) for _ in range(end - 8)))
    return None


def _length_past_eof(path: str, rng: random.Random) -> None:
    size = os.path.getsize(path)
    bogus = rng.choice([size, size * 4, 1 << 40, (1 << 64) - 1])
    with open(path, "r+b") as handle:
        handle.write(struct.pack("<Q", bogus))
    return None


def _truncate(path: str, rng: random.Random) -> set[int] | None:
    size = os.path.getsize(path)
    start = faults.data_start(path)
    cut = rng.randrange(size)
    os.truncate(path, cut)
    if cut < start + BLOCKS * BIG.block_bytes:
        return None  # part of the data (or the header) is gone: every block
    return "any"  # only the checksum table was cut


def _zeroed(path: str, rng: random.Random) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.write(b"\0" * size)
    return None


DAMAGES: dict[str, Damage] = {
    "bitflip-data": _flip_data,
    "bitflip-checksum-table": _flip_table,
    "bitflip-header": _flip_header,
    "header-not-json": _not_json,
    "header-length-past-eof": _length_past_eof,
    "chunk-truncated": _truncate,
    "chunk-zeroed": _zeroed,
}


@pytest.mark.parametrize(
    "damage",
    [pytest.param(name, marks=pytest.mark.fault(name), id=name) for name in DAMAGES],
)
def test_a_damaged_chunk_is_never_served(fault, tmp_path, damage):
    seed = random.randrange(2**32)
    for trial in fault.trials(3, 16):
        rng = random.Random(f"{seed}:{trial}")
        cfg = config(tmp_path / f"t{trial}", fsync="never")
        with KVStore(cfg, BIG) as store:
            chunks = fill(store, f"{damage}:{seed}:{trial}", chunks=3)
        victim = rng.randrange(len(chunks))
        path, victim_keys = chunks[victim]
        must_miss = DAMAGES[damage](path, rng)
        if trial % 2:
            drop_page_cache(p for p, _ in chunks)
        keys = [k for _, ks in chunks for k in ks]
        with KVStore(cfg, BIG) as store:
            ok = fault.read_back(store, keys)
        others = [k for i, (_, ks) in enumerate(chunks) if i != victim for k in ks]
        with KVStore(cfg, BIG) as store:
            fault.durable(store, others, f"seed {seed} trial {trial}:")
        got = ok[victim * BLOCKS : (victim + 1) * BLOCKS]
        where = f"seed {seed} trial {trial}: {damage} hits {got}"
        if must_miss is None:
            assert not any(got), where
        elif must_miss != "any":
            assert isinstance(must_miss, set)
            assert [not hit for hit in got] == [
                r in must_miss for r in range(BLOCKS)
            ], where
        shutil.rmtree(cfg.cache_dir)


def _two_chunks_swapped(fault, tmp_path, seed: int, trial: int) -> None:
    cfg = config(tmp_path / f"t{trial}", fsync="never")
    with KVStore(cfg, BIG) as store:
        chunks = fill(store, f"swap:{seed}:{trial}", chunks=3)
    (a, a_keys), (b, b_keys), (_, c_keys) = chunks
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    if trial % 2:
        drop_page_cache(p for p, _ in chunks)
    with KVStore(cfg, BIG) as store:
        ok = fault.read_back(store, a_keys + b_keys)
        assert not any(ok), f"trial {trial}: a swapped chunk was served: {ok}"
        fault.durable(store, c_keys, f"trial {trial}:")


@pytest.mark.fault("chunk-keys-differ-from-index")
def test_swapped_chunk_files_are_misses(fault, tmp_path):
    seed = random.randrange(2**32)
    for trial in fault.trials(2, 8):
        _two_chunks_swapped(fault, tmp_path, seed, trial)


def _two_namespaces(tmp_path, trial: int):
    """A directory holding one chunk of namespace A and two of B."""
    cfg = config(tmp_path / f"t{trial}", fsync="never")
    spec_a = dataclasses.replace(BIG, model="npukv-test/other")
    with KVStore(cfg, spec_a) as a:
        ((a_path, a_keys),) = fill(a, f"A{trial}", chunks=1)
        a_namespace = a.namespace
    with KVStore(cfg, BIG) as b:
        b_chunks = fill(b, f"B{trial}", chunks=2)
    return cfg, spec_a, a_namespace, (a_path, a_keys), b_chunks


@pytest.mark.fault("foreign-chunk-in-place")
def test_a_chunk_of_another_namespace_under_our_name_is_a_miss(fault, tmp_path):
    for trial in fault.trials(2, 6):
        cfg, _, _, (a_path, _), b_chunks = _two_namespaces(tmp_path, trial)
        (b_path, b_keys), (_, b_other) = b_chunks
        shutil.copyfile(a_path, b_path)  # the other model's bytes, our name
        if trial % 2:
            drop_page_cache([b_path])
        with KVStore(cfg, BIG) as store:
            assert not any(fault.read_back(store, b_keys))
            fault.durable(store, b_other, f"trial {trial}:")


@pytest.mark.fault("foreign-chunk-on-rebuild")
def test_rebuild_does_not_adopt_a_chunk_of_another_namespace(fault, tmp_path):
    for trial in fault.trials(2, 6):
        cfg, spec_a, _, (a_path, a_keys), b_chunks = _two_namespaces(tmp_path, trial)
        b_dir = os.path.dirname(b_chunks[0][0])
        stray = os.path.join(b_dir, f"{random.randrange(1, 2**63):016x}.safetensors")
        shutil.copyfile(a_path, stray)
        shutil.rmtree(os.path.join(cfg.cache_dir, "index"))
        with KVStore(cfg, BIG) as store:  # rebuilds the index from the files
            hits = fault.read_back(store, a_keys)
            if any(hits):
                fault.wrong(sum(hits), f"trial {trial}: B served A's blocks")
            fault.durable(store, [k for _, ks in b_chunks for k in ks])
        assert not os.path.exists(stray), "the foreign file was kept in B's dir"
        with KVStore(cfg, spec_a) as store:
            fault.durable(store, a_keys, f"trial {trial}: A after the rebuild:")
