"""The four executors against each other: forced onto one route each, a read
of the same rows gives the same bytes and the same verdicts, and its bytes are
counted under that route."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npukv_store import KVStore
from npukv_store.store.format_checks import parse_header
from npukv_store.store.read.plan import ReadTuning, Route
from tests.support.blocks import block_tensors
from tests.support.chunks import BLOCKS, aligned_out, chunk_files, evict_from_page_cache

#: the counter each route's bytes land in (the engine's buffered reads have none)
COUNTER = {
    Route.CACHED: "cached_read_bytes",
    Route.DIRECT: "direct_read_bytes",
    Route.STREAMED: "streamed_read_bytes",
}


def read_by(route: Route, config, spec, keys):
    evict_from_page_cache(config.cache_dir)  # cold: O_DIRECT may apply
    out = aligned_out(spec, len(keys))
    with KVStore(config, spec, read_tuning=ReadTuning(only_route=route)) as store:
        ok = store.read(keys, out)
        counters = store.stats().counters
    return ok, out, counters


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True))
def test_every_route_reads_the_same_bytes(stored, picks):
    config, spec, keys = stored
    wanted = [keys[i] for i in picks]
    expected = block_tensors(spec, wanted)
    for route in Route:
        ok, out, counters = read_by(route, config, spec, wanted)
        assert ok == [True] * len(wanted), route
        for name, array in expected.items():
            np.testing.assert_array_equal(out[name], array, err_msg=str(route))
        others = {c for r, c in COUNTER.items() if r is not route}
        assert all(counters[c] == 0 for c in others), (route, counters)
        total = len(wanted) * spec.block_bytes
        if route is Route.DIRECT:  # ranges the header read cached stay buffered
            assert 0 < counters[COUNTER[route]] <= total
        elif route in COUNTER:
            assert counters[COUNTER[route]] == total


def test_every_route_misses_the_same_corrupt_row(stored):
    config, spec, keys = stored
    (path,) = chunk_files(config.cache_dir).values()
    fd = os.open(path, os.O_RDWR)
    try:
        entry = parse_header(fd, str(path)).layers[1][0]
        offset = entry.begin + 9 * entry.row_bytes + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x5A]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    wanted = keys[4:20]
    pristine = f"{config.cache_dir}.corrupt"
    shutil.copytree(config.cache_dir, pristine)
    for route in Route:  # each read quarantines the chunk: start again
        shutil.rmtree(config.cache_dir)
        shutil.copytree(pristine, config.cache_dir)
        os.sync()  # dirty pages cannot be dropped: write the copies back
        ok, _, counters = read_by(route, config, spec, wanted)
        assert ok == [i != 5 for i in range(16)], route  # row 9 is key index 5
        assert counters["checksum_errors"] == 1, route


def test_direct_is_not_forced_onto_unaligned_buffers(stored):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS, misalign=64)
    tuning = ReadTuning(only_route=Route.DIRECT)
    with KVStore(config, spec, read_tuning=tuning) as store:
        assert store.read(keys, out) == [True] * BLOCKS
        assert store.stats().counters["direct_read_bytes"] == 0
    for name, array in block_tensors(spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


@pytest.mark.parametrize("route", list(Route))
def test_the_plan_a_store_reports_is_the_route_it_takes(stored, route):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    with KVStore(config, spec, read_tuning=ReadTuning(only_route=route)) as store:
        (chunk_id,) = {loc[0] for loc in store.index.locate(keys)}
        plan = store.read_plan(chunk_id)
    assert plan is not None
    routes = set(plan.routes().values())
    if route is Route.DIRECT:  # the ranges the header read cached stay buffered
        assert Route.DIRECT in routes
        assert routes <= {Route.DIRECT, Route.ENGINE}
    else:
        assert routes == {route}
    assert route.value in plan.explain()
