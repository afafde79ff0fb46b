"""The connector with the remote tier, on a real master, without an engine:
workers write through and load remote blocks bit-exact; the scheduler finds
remote hits after the local prefix, splits the load at it, and never waits
past its step budget."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the connector needs vLLM")

from npukv_store import KVStore  # noqa: E402
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata  # noqa: E402
from npukv_store.connector.scheduler.remote_lookup import GIVE_UP_STEPS  # noqa: E402
from npukv_store.connector.scheduler.side import SchedulerSide  # noqa: E402
from npukv_store.remote.tier import open_tier, release_tier  # noqa: E402
from tests.support.connector import (  # noqa: E402
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    cpu_caches,
    engine_config,
    make_request,
    worker_for,
)
from tests.support.remote import Recording, secret_file  # noqa: E402


def remote(master, **kw) -> dict:
    """The tier's keys; every node of a test shares the master's directory's
    secret."""
    return {
        "remote_store": "mooncake",
        "mooncake_master": master.address,
        "mooncake_segment_size": "64MiB",
        "mooncake_local_buffer": "16MiB",
        "remote_secret_file": secret_file(master.log_path.parent),
        **kw,
    }


def wait_up(tier, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not tier.up:
        assert time.monotonic() < end, "the tier did not come up"
        time.sleep(0.02)


def save_blocks(tmp_path, master, keys, src_ids, seed=1):
    """A worker of 'node A' saves ``keys`` from blocks ``src_ids``; returns
    its caches (the expected bytes)."""
    source = cpu_caches(seed=seed)
    saver = worker_for(tmp_path / "a", source, layerwise="off", **remote(master))
    assert saver.remote is not None
    wait_up(saver.remote)
    saver.bind(NPUKVMetadata(saves=[BlockTransfer("r", src_ids, [b"".join(keys)])]))
    for name in LAYERS:
        saver.wait_layer(name)
        saver.save_layer(name)
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    counts = saver.remote.counters.snapshot()
    assert counts.get("remote_put_blocks") == len(keys), counts
    assert saver.store.ring_used_bytes() == 0
    return saver, source


@pytest.mark.parametrize("mode", ["off", "on"])
def test_remote_blocks_load_bit_exact_and_are_promoted(tmp_path, mooncake_master, mode):
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    saver, source = save_blocks(tmp_path, mooncake_master, keys, [3, 17, 4, 30])
    target = cpu_caches(seed=2)
    loader = worker_for(
        tmp_path / "b", target, layerwise=mode, **remote(mooncake_master)
    )
    missing = bytes([99]) * 16  # not in the tier: a load error, recomputed
    dst = [8, 9, 10, 11]
    loads = [
        BlockTransfer("r", dst, [b"".join(keys)], remote=True),
        BlockTransfer("r", [12], [missing], remote=True),
    ]
    loader.bind(NPUKVMetadata(loads=loads))
    loader.start_load()
    for name in LAYERS:
        loader.wait_layer(name)
        loader.save_layer(name)
    loader.finish_step()
    assert loader.take_load_errors() == {12}
    for name in LAYERS:
        torch.testing.assert_close(target[name][dst], source[name][[3, 17, 4, 30]])
    stats = loader.take_stats()
    assert stats is not None
    assert stats.data["remote_load_blocks"] == 4
    assert stats.data["remote_load_missing"] == 1
    assert loader.store is not None
    assert loader.store.flush(timeout_s=30)
    assert loader.store.lookup(keys) == 4, "promoted into the local store"
    counts = loader.remote.counters.snapshot() if loader.remote else {}
    assert counts.get("remote_put_blocks") == 4, "promoted blocks are not put back"
    loader.close()
    saver.close()


def _scheduler(tmp_path, master, **kw) -> SchedulerSide:
    from npukv_store import StoreConfig

    vllm_config, kv_cache_config = engine_config()
    cfg = StoreConfig(cache_dir=str(tmp_path), ring_size="8MiB", **remote(master, **kw))
    side = SchedulerSide(vllm_config, kv_cache_config, cfg)
    assert side.tier is not None
    wait_up(side.tier)
    return side


def _match(side, request, computed=0, steps=5):
    """match() as vLLM calls it: again in the next step while it says None."""
    for _ in range(steps):
        found = side.match(request, computed)
        if found is not None:
            return found
        side.build_meta(_NoSchedule())
    raise AssertionError("match kept answering None")


class _NoSchedule:
    num_scheduled_tokens: dict = {}
    scheduled_new_reqs: list = []
    scheduled_cached_reqs = None
    finished_req_ids: set = set()


def test_scheduler_claims_remote_blocks_after_the_local_prefix(
    tmp_path, mooncake_master
):
    tokens = list(range(3, 3 + 6 * BLOCK + 1))  # 6 full blocks and one token
    request = make_request("q", tokens)
    side = _scheduler(tmp_path / "sched", mooncake_master)
    keys = side._keys(side._state(request), 6)[0][0]
    # node A saved all six blocks to the tier; this node holds the first two
    saver, _ = save_blocks(tmp_path, mooncake_master, keys, list(range(6)))
    assert side.store is not None
    with KVStore(side.settings, side.store.spec) as local:
        local.put(keys[:2], _zero_rows(local.spec, 2))
    assert _match(side, request) == 6 * BLOCK
    blocks = (list(range(1, 1 + 6)),)
    side.allocated(request, blocks, 6 * BLOCK)
    (local_load, remote_load) = side._loads["q"]
    assert (local_load.remote, local_load.block_ids) == (False, [1, 2])
    assert (remote_load.remote, remote_load.block_ids) == (True, [3, 4, 5, 6])
    stats = side.take_stats()
    assert stats is not None
    assert stats.data["remote_hit_tokens"] == 4 * BLOCK
    saver.close()
    side.close()


def _spy_waits(tier) -> list[float]:
    """Each wait_s the scheduler gives tier.lookup from now on."""
    waits: list[float] = []
    lookup = tier.lookup

    def spied(fingerprint, keys, wait_s):
        waits.append(wait_s)
        return lookup(fingerprint, keys, wait_s)

    tier.lookup = spied
    return waits


def test_scheduler_waits_at_most_its_budget_and_then_serves_locally(
    tmp_path, mooncake_master
):
    """A probe that does not come back (blocked until the test ends) holds no
    step: each step gives its lookups at most its budget (remote_timeout_ms)
    to wait and returns while the probe is still out; after GIVE_UP_STEPS
    the request is served locally, the one probe never sent again."""
    side = _scheduler(tmp_path / "sched", mooncake_master, remote_timeout_ms=5)
    assert side.tier is not None
    tier = side.tier
    released = threading.Event()
    probes: list[str] = []  # the thread of each probe sent
    returned: list[str] = []

    def hangs(names):  # a probe that never comes back in time
        probes.append(threading.current_thread().name)
        released.wait(30.0)  # a generous deadline to fail by
        returned.append(probes[-1])
        return 0

    tier._probe = hangs  # type: ignore[method-assign]
    waits = _spy_waits(tier)
    request = make_request("slow", list(range(3, 3 + 4 * BLOCK + 1)))
    answers, steps = [], []  # per step: the waits its lookups were given
    try:
        for _ in range(GIVE_UP_STEPS + 1):
            asked = len(waits)
            answers.append(side.match(request, 0))
            assert not returned, "a step returned only once the probe did"
            steps.append(waits[asked:])
            side.build_meta(_NoSchedule())
        assert answers == [None] * GIVE_UP_STEPS + [0]
        budget = side.settings.remote_timeout_ms / 1e3
        assert all(step and sum(step) <= budget for step in steps), (steps, budget)
        assert probes == ["npukv-remote-ctl_0"], probes
    finally:
        released.set()
        side.close()


def test_scheduler_serves_locally_at_once_when_the_master_is_down(
    tmp_path, mooncake_master
):
    """The master killed: every step gives its lookups at most its budget
    to wait, no Mooncake call runs on the scheduler's thread, and once the
    tier is down the lookups send nothing (a local-only answer at once)."""
    side = _scheduler(tmp_path / "sched", mooncake_master)
    assert side.tier is not None
    tier = side.tier
    tier._client = client = Recording(tier._client)
    waits = _spy_waits(tier)
    mooncake_master.stop()
    found, steps = [], []
    sent_when_down = None  # the calls sent by the time it was seen down
    down_at = 0  # the request it was first seen down at
    end = time.monotonic() + 5.0
    i = 0
    # until the breaker opens, and 10 requests more
    while sent_when_down is None or len(found) < down_at + 10:
        assert time.monotonic() < end, "the tier never noticed the master died"
        if sent_when_down is None and not tier.up:
            sent_when_down, down_at = len(client.calls), len(found)
        request = make_request(f"r{i}", list(range(5 + i, 5 + i + 3 * BLOCK + 1)))
        asked = len(waits)
        found.append(side.match(request, 0))
        steps.append(waits[asked:])
        side.build_meta(_NoSchedule())
        i += 1
    assert set(found) <= {0, None}
    assert found[-1] == 0, "the tier is down: a local-only answer at once"
    budget = side.settings.remote_timeout_ms / 1e3
    assert all(sum(step) <= budget for step in steps), (max(map(sum, steps)), budget)
    threads = {thread for _, thread in client.calls}
    assert threads <= {"npukv-remote-ctl_0"}, f"Mooncake called on {threads}"
    later = client.calls[sent_when_down:]
    assert not [c for c in later if c[0] == "batch_is_exist"], later
    assert not tier.up
    side.close()


def test_one_tier_per_process_and_master(tmp_path, mooncake_master):
    from npukv_store import StoreConfig

    cfg = StoreConfig(cache_dir=str(tmp_path), **remote(mooncake_master))
    first, second = open_tier(cfg), open_tier(cfg)
    assert first is second
    assert first is not None
    release_tier(first)
    assert not first._closed, "still used"
    release_tier(second)
    assert first._closed


def _zero_rows(spec, count):
    import numpy as np

    return {
        name: np.zeros((count, part.row_bytes), np.uint8)
        for layer in spec.layers
        for name, part in zip(layer.tensor_names(), layer.parts, strict=True)
    }


assert NUM_BLOCKS >= 13
