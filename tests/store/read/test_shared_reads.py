"""A namespace that several workers load (MLA's latent cache under TP > 1) is
read through the page cache: four workers loading the same cold hit at once
make the disk serve it about once, not four times (docs/decisions/0063).

The figure is a byte count (the sum of the workers' ``/proc/<pid>/io``
``read_bytes``), not a time. The unshared control shows that the count sees
reads around the cache: there each worker reads the whole hit with O_DIRECT.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from bench.mla_reads import ROW_BYTES, fill, io_read_bytes, load_together, mla_spec
from npukv_store import KVStore, StoreConfig
from npukv_store.store.read.plan import ReadTuning
from npukv_store.store.read.reader import loaded_by_several_workers
from tests.support.chunks import evict_from_page_cache

pytestmark = pytest.mark.integration

WORKERS = 4
LAYERS = 2
BLOCKS_PER_CHUNK = 64
CHUNKS = 3


@pytest.mark.parametrize(
    ("rank_independent", "tp_size", "shared"),
    [(True, 4, True), (True, 16, True), (True, 1, False), (False, 4, False)],
)
def test_only_rank_independent_namespaces_under_tp_are_shared(
    rank_independent, tp_size, shared
):
    spec = dataclasses.replace(
        mla_spec(tp_size, rank=tp_size - 1, layers=1),
        rank_independent=rank_independent,
    )
    assert loaded_by_several_workers(spec) is shared


def test_a_shared_namespace_plans_no_direct_read_of_a_cold_chunk(tmp_path):
    cache_dir = str(tmp_path / "cache")
    fill(cache_dir, 1, WORKERS, LAYERS, BLOCKS_PER_CHUNK)
    evict_from_page_cache(cache_dir)
    config = StoreConfig(cache_dir=cache_dir, capacity="1GiB")
    plans = {}
    for shared in (True, False):
        with KVStore(config, mla_spec(WORKERS, 1, shared, LAYERS)) as store:
            (chunk_id,) = [c.chunk_id for c in store.index.iter_chunks()]
            plans[shared] = store.read_plan(chunk_id)
    assert not any(r.direct for r in plans[True].requests), plans[True].explain()
    assert any(r.direct for r in plans[False].requests), plans[False].explain()
    tuning = ReadTuning(buffered_when_shared=False)  # the A/B switch
    with KVStore(config, mla_spec(WORKERS, 1, True, LAYERS), read_tuning=tuning) as s:
        assert any(r.direct for r in s.read_plan(chunk_id).requests)


@pytest.fixture
def cold_hit(tmp_path):
    if io_read_bytes() is None:
        pytest.skip("/proc/<pid>/io read_bytes is not available here")
    cache_dir = str(tmp_path / "cache")
    nbytes = CHUNKS * BLOCKS_PER_CHUNK * ROW_BYTES * LAYERS
    keys = fill(cache_dir, nbytes, WORKERS, LAYERS, BLOCKS_PER_CHUNK)
    assert len(keys) == CHUNKS * BLOCKS_PER_CHUNK
    return cache_dir, keys, nbytes


def load_cold(cold_hit, shared: bool) -> tuple[int, list[dict]]:
    cache_dir, keys, hit_bytes = cold_hit
    evict_from_page_cache(cache_dir)  # skips where pages cannot be dropped
    results = load_together(cache_dir, keys, WORKERS, shared, LAYERS)
    assert all(r["all_read"] for r in results), results
    disk = sum(r["read_bytes"] for r in results)
    # the hit was cold and the count sees it: the workers' reads reached the
    # disk at least once (else the bound below would hold vacuously)
    if disk < 0.9 * hit_bytes:
        pytest.skip(f"read_bytes counted {disk} of a {hit_bytes}-byte cold hit")
    return disk, results


@pytest.mark.timeout(240)
def test_four_workers_of_a_shared_namespace_read_a_cold_hit_once(cold_hit):
    hit_bytes = cold_hit[2]
    disk, results = load_cold(cold_hit, shared=True)
    assert disk <= 1.25 * hit_bytes, (disk / hit_bytes, results)
    assert [r["direct_read_bytes"] for r in results] == [0] * WORKERS


@pytest.mark.timeout(240)
def test_unshared_workers_each_read_the_cold_hit_around_the_cache(cold_hit):
    """The control: what a shared namespace's workers did before."""
    hit_bytes = cold_hit[2]
    disk, results = load_cold(cold_hit, shared=False)
    assert [r["direct_read_bytes"] for r in results] == [hit_bytes] * WORKERS
    assert disk >= 0.95 * WORKERS * hit_bytes, (disk / hit_bytes, results)


def test_read_bytes_is_this_process_s_own_count():
    """``io_read_bytes`` parses the kernel's line (or says it cannot)."""
    found = io_read_bytes()
    if found is None:
        assert not os.path.exists("/proc/self/io")
    else:
        assert found >= 0
        assert io_read_bytes(os.getpid()) is not None
