"""MooncakeTier when things go wrong: the master killed, restarted, never
there at setup, and a client whose calls hang. Nothing may raise, no caller
may wait longer than it asked, and an outage costs one warning each way."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from npukv_store.hashing import namespace_fingerprint
from npukv_store.remote import tier as tier_mod
from npukv_store.remote import transfers
from npukv_store.remote.breaker import CLOSED
from npukv_store.remote.client import FetchResult
from npukv_store.remote.tier import STALL_S, MooncakeTier
from npukv_store.remote.transfers import load_deadline_s
from npukv_store.remote.value import SUMS_OFFSET, ValueLayout
from tests.support.blocks import tiny_spec
from tests.support.mooncake import MooncakeMaster, free_ports, require_mooncake
from tests.support.remote import (
    HangingClient,
    Recording,
    expected_values,
    fake_config,
    join_closes,
    load_buffer,
    make_keys,
    put_through,
    tier_config,
    wait_until,
)

LOGGER = "npukv_store.remote.tier"
CTL = "npukv-remote-ctl_0"  # the tier's control thread
SPEC = tiny_spec()
FP = namespace_fingerprint(SPEC)
LAYOUT = ValueLayout.for_spec(SPEC)


def lines(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def timed(fn, *args):
    began = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - began


def value_pieces(values: np.ndarray, layout: ValueLayout) -> list:
    """Per value of ``values``: its body after the prefix and MAC, one piece."""
    base, size = values.ctypes.data, layout.value_bytes
    return [
        [(base + i * size + SUMS_OFFSET, size - SUMS_OFFSET)]
        for i in range(len(values))
    ]


# -- the master killed, then restarted -------------------------------------------------


def test_dead_master_costs_one_warning_and_no_waiting(nodes, mooncake_master, caplog):
    """The master stopped: lookups turn 0 after a probe or two, one warning
    says so, and nobody waits for the dead master: no Mooncake call runs on
    the caller's thread, and while down a put, a load and the store's own
    writes send nothing (dropped, released, counted)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = nodes.tier()
    tier._client = client = Recording(tier._client)
    store = nodes.store(tier, SPEC)
    keys = make_keys("before", 8)
    put_through(store, keys)
    assert tier.lookup(FP, keys, 0.5) == 8  # seen present (and cached)

    mooncake_master.stop()
    client.calls.clear()
    answers = []
    end = time.monotonic() + 2.5  # past two health probes (1 s, then 2 s)
    while time.monotonic() < end:
        answers.append(tier.lookup(FP, make_keys(f"dead{len(answers)}", 4), 0.02))
        time.sleep(0.005)
    threads = {thread for _, thread in client.calls}
    assert threads == {"npukv-remote-ctl_0"}, f"Mooncake called on {threads}"
    first_zero = answers.index(0)
    assert first_zero <= 3, answers[:10]
    assert set(answers[first_zero:]) == {0}, answers
    assert not tier.up
    assert tier.breaker.state != CLOSED
    assert tier.lookup(FP, keys, 0.02) == 0  # a cached presence is not served
    down = lines(caplog, "remote tier is down")
    assert len(down) == 1, [r.getMessage() for r in down]
    assert down[0].levelno == logging.WARNING
    assert lines(caplog, "remote tier is back") == []

    # a put offered while down is dropped, counted and its region released
    released = []
    values = expected_values(SPEC, make_keys("offer", 2), tier.keys.mac_key)
    sent = len(client.calls)
    offered = tier.offer_blocks(
        SPEC, FP, make_keys("offer", 2),
        value_pieces(values, LAYOUT), lambda: released.append(True),
    )  # fmt: skip
    assert offered is False
    assert released == [True]
    assert tier.counters.snapshot().get("remote_put_dropped") == 2
    # a load while down is a miss at once
    out = load_buffer(tier, LAYOUT, 8)
    result = tier.fetch(FP, LAYOUT, keys, out)
    assert result.ok == [False] * 8
    assert not result.abandoned
    # and the store goes on locally, its ring not held by the dead tier
    more = make_keys("while-down", 8)
    put_through(store, more)
    assert client.sent("batch_put_from", "batch_get_into") == 0, client.calls[sent:]
    assert store.lookup(more) == 8
    assert store.ring_used_bytes() == 0
    assert tier.counters.snapshot().get("remote_put_dropped") == 10
    assert len(lines(caplog, "remote tier is down")) == 1


def test_restarted_master_is_found_again(nodes, mooncake_master, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = nodes.tier()
    store = nodes.store(tier, SPEC)
    old = make_keys("old", 8)
    put_through(store, old)
    # restart(), in its two halves, so that the tier sees the master gone
    mooncake_master.stop()
    assert wait_until(
        lambda: tier.lookup(FP, make_keys("probe", 2), 0.02) == 0 and not tier.up, 2.0
    )
    mooncake_master.start()
    polls = 0

    def back() -> bool:
        nonlocal polls
        polls += 1
        tier.lookup(FP, make_keys(f"poll{polls}", 2), 0.02)
        return tier.up

    assert wait_until(back, 15.0, step=0.05), tier.breaker.reason
    assert len(lines(caplog, "remote tier is down")) == 1
    assert len(lines(caplog, "remote tier is back")) == 1
    # the restarted master is empty; new puts and loads work
    assert tier.lookup(FP, old, 0.5) == 0
    # The tier is back as soon as the master answers, but the client mounts
    # its segment again by itself a moment later (up to ~2 s): until then
    # the pool has no room and puts are rejected as full (-200), the blocks
    # kept locally. New blocks each try, as a stored block is not put again.
    attempts = 0

    def put_new() -> bool:
        nonlocal attempts
        attempts += 1
        before = tier.counters.snapshot().get("remote_put_blocks", 0)
        put_through(store, make_keys(f"new{attempts}", 8))
        return tier.counters.snapshot().get("remote_put_blocks", 0) == before + 8

    assert wait_until(put_new, 5.0, step=0.1), tier.counters.snapshot()
    new = make_keys(f"new{attempts}", 8)
    counts = tier.counters.snapshot()
    assert counts.get("remote_put_blocks") == 16, counts
    assert counts.get("remote_put_failed", 0) == 0, counts
    assert tier.lookup(FP, new, 0.5) == 8
    out = load_buffer(tier, LAYOUT, 8)
    assert tier.fetch(FP, LAYOUT, new, out).ok == [True] * 8
    assert np.array_equal(out, expected_values(SPEC, new, tier.keys.mac_key))
    assert tier.fetch(FP, LAYOUT, old, out).ok == [False] * 8
    assert len(lines(caplog, "remote tier is back")) == 1


# -- a client whose calls hang (a master that accepts and never answers) ---------------


@pytest.fixture
def hanging(tmp_path):
    """make(client) -> a tier over that fake client; released and closed after."""
    made: list[tuple[MooncakeTier, HangingClient]] = []

    def make(client: HangingClient) -> MooncakeTier:
        config = fake_config(tmp_path / f"fake{len(made)}")
        tier = MooncakeTier(config, client_factory=lambda: client)
        made.append((tier, client))
        return tier

    yield make
    for tier, client in made:
        client.released.set()
        tier.close()


def test_hanging_lookups_never_block_the_caller(hanging, caplog):
    """A probe that never returns (its fake call blocks until the fixture's
    teardown) never holds the caller: every lookup returns while that call
    is still inside the fake, None while it is young, then 0 once it is
    counted stalled (STALL_S), and nothing more is sent. Each None waited
    at least its wait_s (a lower bound: a loaded machine only adds to it);
    no upper bound on any wait is asserted, what it did not wait for is."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = HangingClient(hang_s=60.0)  # a generous deadline to fail by
    tier = hanging(client)
    assert wait_until(lambda: tier.up, 2.0)
    keys = make_keys("hang", 4)
    began = time.monotonic()
    pending, zeros = [], []  # (seconds since the first probe, call time)
    while len(zeros) < 20:
        answer, took = timed(tier.lookup, FP, keys, 0.02)
        at = time.monotonic() - began
        # the caller is back and the probe is still hanging in the fake
        assert client.inside == 1, (answer, at)
        assert client.exists == 1, (answer, at)
        if answer is None:
            assert not zeros, f"None again at {at:.2f} s, after a 0"
            pending.append(took)
        else:
            assert answer == 0, answer
            zeros.append((at, took))
        time.sleep(0.002)  # a scheduler's steps, not a busy loop
    assert pending, "the first lookups should not be answered yet"
    assert min(pending) >= 0.02, "a lookup did not wait its wait_s"
    assert zeros[0][0] >= STALL_S - 0.05, "given up on before STALL_S"
    assert not tier.up
    assert tier.breaker.wait_s == 1.0  # one stuck call: one failure
    assert tier.counters.snapshot().get("remote_failures") == 1
    assert client.exists == 1  # one probe out, asked for again, not resent
    assert set(client.threads) == {"npukv-remote-ctl_0"}, "a call on the caller's"
    assert len(lines(caplog, "remote tier is down")) == 1
    # another chain while down: 0 while the probe still hangs, nothing sent
    assert tier.lookup(FP, make_keys("other", 2), 0.02) == 0
    assert client.inside == 1
    assert client.exists == 1


def test_hanging_load_is_abandoned_at_its_deadline(hanging, caplog):
    """A get that never returns (blocked in the fake until teardown) is
    abandoned: the caller is back with every block a miss while the call is
    still inside the fake, having waited at least its deadline (a lower
    bound); the tier goes down and the next load and lookup send nothing."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = HangingClient(hang_s=60.0)  # a generous deadline to fail by
    tier = hanging(client)
    assert wait_until(lambda: tier.up, 2.0)
    keys = make_keys("hang-load", 16)
    out = np.zeros((16, LAYOUT.value_bytes), np.uint8)
    tier.register(out.ctypes.data, out.nbytes)
    deadline = load_deadline_s(out.nbytes)
    result, took = timed(tier.fetch, FP, LAYOUT, keys, out)
    assert client.inside == 1, "the caller waited for the get to return"
    assert result.abandoned
    assert result.pending is not None
    assert not result.pending.done()
    assert result.ok == [False] * 16
    assert took >= deadline - 0.01, (took, deadline)  # it waited its deadline
    assert client.threads[-1] == "npukv-remote-get_0", client.threads
    assert not tier.up
    assert tier.counters.snapshot().get("remote_load_errors") == 16
    assert len(lines(caplog, "remote tier is down")) == 1
    # the next load and lookup are misses with nothing sent, the get still out
    again = tier.fetch(FP, LAYOUT, keys, np.zeros_like(out))
    assert again.ok == [False] * 16
    assert not again.abandoned
    assert tier.lookup(FP, keys, 0.02) == 0
    assert client.gets == 1
    assert client.exists == 0
    assert client.inside == 1


def test_a_get_that_never_returns_leaves_one_abandoned_buffer(hanging, caplog):
    """A peer that never answers one get (review finding 6): the tier sends
    no get, probe or lookup while that call is out, however long the
    loads keep coming (10 s here: the breaker would have reopened and
    closed about 7 times), so one load buffer is set aside, not one per
    load; once the call returns the buffer is freed and the tier comes back.
    No load waits behind the stuck get: each returns while it is still in
    the fake, none queues another get, and none waits on its future."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = HangingClient(hang_s=600.0)  # until released
    tier = hanging(client)
    assert wait_until(lambda: tier.up, 2.0)
    loads = remote_loads(tier)
    keys = make_keys("never", 16)
    ids = list(range(16))
    submitted = spy_submits(tier._get)
    began = time.monotonic()
    held: list[int] = []
    watched = None
    while time.monotonic() - began < 10.0:
        assert loads.load([keys], [ids]) == set(ids)
        assert client.inside == 1, "a load returned only once the get did"
        held.append(len(loads._abandoned))
        assert held[-1] <= 1, f"{held[-1]} buffers abandoned after {len(held)} loads"
        if watched is None:  # every later load may look at the call, not wait
            buffer, future = loads._abandoned[0]
            watched = Watched(future)
            loads._abandoned[0] = (buffer, watched)
        time.sleep(0.02)
    assert client.gets == 1, f"{client.gets} gets sent behind the stuck one"
    assert submitted == [1], "a get was queued behind the stuck one"
    assert held[-1] == 1
    assert watched.waits == 0, "a load waited for the stuck get"
    assert client.sizes == 0, "a probe was sent while the get was out"
    assert not tier.up
    assert len(lines(caplog, "remote tier is down")) == 1
    assert lines(caplog, "remote tier is back") == []
    # the call returns: its buffer is freed at the next load, and the
    # breaker's next probe brings the tier back
    client.hang_s = 0.0
    client.released.set()
    assert wait_until(lambda: (loads.load([keys], [ids]), tier.up)[1], 5.0)
    back = [r for r in caplog.records if "batch_get_into returned" in r.message]
    assert len(back) == 1
    sent = client.gets
    loads.load([keys], [ids])
    assert loads._abandoned == []
    assert client.gets == sent + 1, "loads are sent again"
    loads.close()


class Watched:
    """An abandoned get's future, as RemoteLoads keeps it: whoever waits on
    it (result, exception) is counted; done() is only a look."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.waits = 0

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout=None):
        self.waits += 1
        return self.future.result(timeout)

    def exception(self, timeout=None):
        self.waits += 1
        return self.future.exception(timeout)


def spy_submits(pool) -> list[int]:
    """Count the calls submitted to one of the tier's executors from now on."""
    count = [0]
    submit = pool.submit

    def counted(*args, **kw):
        count[0] += 1
        return submit(*args, **kw)

    pool.submit = counted
    return count


def test_a_stuck_get_holds_the_tier_down_until_it_returns(hanging, monkeypatch):
    """The tier alone (any caller, a fresh buffer each time): while the
    abandoned get is out nothing is sent, no probe closes the breaker, and
    no later load is abandoned, however fast the breaker would retry."""
    monkeypatch.setattr(transfers, "load_deadline_s", lambda nbytes: 0.01)
    client = HangingClient(hang_s=600.0)
    tier = hanging(client)
    tier.breaker.first_wait_s = tier.breaker.max_wait_s = 0.02
    assert wait_until(lambda: tier.up, 2.0)
    keys = make_keys("stuck", 4)
    abandoned = 0
    began = time.monotonic()
    while time.monotonic() - began < 2.0:
        out = np.zeros((4, LAYOUT.value_bytes), np.uint8)
        abandoned += tier.fetch(FP, LAYOUT, keys, out).abandoned
        assert tier.lookup(FP, keys, 0.01) == 0
        time.sleep(0.005)
    assert abandoned == 1
    assert client.gets == 1
    assert client.sizes == 0, "probed while the get was out"
    assert client.exists == 0
    assert not tier.up
    client.hang_s = 0.0
    client.released.set()
    assert wait_until(lambda: (tier.lookup(FP, keys, 0.01), tier.up)[1], 2.0)
    out = np.zeros((4, LAYOUT.value_bytes), np.uint8)
    assert not tier.fetch(FP, LAYOUT, keys, out).abandoned
    assert client.gets == 2


class AbandoningTier:
    """A tier whose every load is abandoned, its call never returning:
    RemoteLoads must bound what it sets aside by itself."""

    def __init__(self) -> None:
        self.fetches = 0
        self.calls: list[Future] = []

    def register(self, address: int, nbytes: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def fetch(self, fingerprint, layout, keys, out) -> FetchResult:
        self.fetches += 1
        self.calls.append(Future())
        return FetchResult([False] * len(keys), abandoned=True, pending=self.calls[-1])


def test_remote_loads_set_aside_at_most_one_buffer():
    from npukv_store.connector.worker.remote_loads import MAX_ABANDONED

    tier = AbandoningTier()
    loads = remote_loads(tier)  # type: ignore[arg-type]
    keys, ids = make_keys("aside", 4), list(range(4))
    for _ in range(50):
        assert loads.load([keys], [ids]) == set(ids)
        assert len(loads._abandoned) <= MAX_ABANDONED
    assert tier.fetches == MAX_ABANDONED, "asked the tier with a buffer still out"
    kept = loads._abandoned[0][0]
    tier.calls[0].set_result([])  # the stuck call returns: freed, asked again
    assert loads.load([keys], [ids]) == set(ids)
    assert tier.fetches == MAX_ABANDONED + 1
    assert all(buffer is not kept for buffer, _ in loads._abandoned)
    loads.close()


def remote_loads(tier: MooncakeTier):
    """A worker's RemoteLoads over ``tier`` for SPEC, on the CPU backend
    (no layers: a fake tier never gives a block to copy)."""
    from types import SimpleNamespace

    from npukv_store.connector.worker.remote_loads import RemoteLoads
    from npukv_store.device import get_backend

    backend = get_backend("cpu")
    store = SimpleNamespace(spec=SPEC, fingerprint=FP)
    return RemoteLoads(tier, [store], [], backend, backend.new_stream(), False)


class GatedSetup(HangingClient):
    """Its first setup hangs until ``gate`` is set (60 s at most: a
    generous deadline to fail by), the later ones ``setup_s``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()

    def setup(self, *args) -> int:
        if self.setups == 0:
            self.setups += 1
            self.threads.append(threading.current_thread().name)
            self.inside += 1
            try:
                self.gate.wait(60.0)
            finally:
                self.inside -= 1
            return self.setup_rc
        return super().setup(*args)


def test_setup_is_retried_at_the_breakers_pace(hanging):
    """A setup that fails while lookups keep coming is tried again once per
    breaker wait (1 s, 2 s, ...), not once per lookup; no lookup waits for
    a setup: every one returns 0 while the first setup hangs in the fake."""
    client = GatedSetup(setup_s=0.4, setup_rc=-1)
    tier = hanging(client)
    assert wait_until(lambda: client.inside == 1, 10.0)
    for i in range(20):
        assert tier.lookup(FP, make_keys(f"gated{i}", 2), 0.02) == 0
        assert client.inside == 1, "a lookup waited for the setup"
        assert client.setups == 1
        time.sleep(0.01)
    client.gate.set()  # it fails; the next ones take 0.4 s and fail too
    answers = []
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        answers.append(tier.lookup(FP, make_keys("early", 2), 0.02))
        time.sleep(0.01)
    assert set(answers) == {0}
    assert not tier.up
    # 0.0 (fails, wait 1 s), 1.0 (fails at 1.4, wait 2 s), next at 3.4
    assert client.setups <= 3, f"{client.setups} setups in 3 s"
    assert client.setups >= 2
    assert set(client.threads) == {"npukv-remote-ctl_0"}, "a setup on the caller's"


# -- no master at setup ----------------------------------------------------------------


def test_tier_started_before_its_master_comes_up_by_itself(
    tmp_path, caplog, monkeypatch
):
    """Lookups are 0 at once, the process never stops (Mooncake's setup holds
    the GIL for the ~4.5 s it takes to fail against no master, so the tier
    must not call it then), and the tier comes up once the master does.
    Asserted on what was called: while the master refuses connections no
    client is made (no setup), every dial and Mooncake call runs on the
    tier's ctl thread, never the caller's, and the breaker's first probe
    after the master is up sets the client up, with its wait not backed off
    past one failed retry (2 s)."""
    require_mooncake()
    caplog.set_level(logging.INFO, logger=LOGGER)
    rpc_port, metrics_port = free_ports(2)
    master = MooncakeMaster(tmp_path, rpc_port=rpc_port, metrics_port=metrics_port)
    made: list[Recording] = []  # each Mooncake client the tier made
    dials: list[tuple[bool, str]] = []  # (master listening, thread) per dial
    real_client, real_listens = tier_mod.new_client, tier_mod.master_listens

    def recorded_client():
        made.append(Recording(real_client()))
        return made[-1]

    def recorded_listens(address: str, timeout_s: float = 0.5) -> bool:
        listening = real_listens(address, timeout_s)
        dials.append((listening, threading.current_thread().name))
        return listening

    # the tier's factory stays `new_client`: it dials before each setup
    monkeypatch.setattr(tier_mod, "new_client", recorded_client)
    monkeypatch.setattr(tier_mod, "master_listens", recorded_listens)
    answers: list[int | None] = []

    def poll(tag: str) -> int | None:
        answers.append(tier.lookup(FP, make_keys(tag, 2), 0.02))
        return answers[-1]

    tier = MooncakeTier(tier_config(master.address, tmp_path / "node"))
    try:
        assert wait_until(lambda: tier.breaker.state != CLOSED, 10.0, step=0.01)
        # a scheduler's lookups until the breaker's first retry dialled too
        assert wait_until(lambda: poll("nomaster") == 0 and len(dials) >= 2, 10.0)
        assert not tier.up
        assert set(answers) == {0}, answers
        assert made == [], "a client was set up while the master refused"
        assert dials == [(False, CTL)] * 2, dials
        assert tier.breaker.wait_s == 2 * tier.breaker.first_wait_s
        assert len(lines(caplog, "remote tier is down")) == 1
        master.start()

        def up() -> bool:
            return poll("poll") is not None and tier.up

        assert wait_until(up, 20.0, step=0.05), tier.breaker.reason  # to fail by
        assert dials[2:] == [(True, CTL)], "not up at the first probe after"
        assert len(made) == 1, f"{len(made)} clients made"
        assert made[0].calls[0] == ("setup", CTL), made[0].calls
        called = {thread for _, thread in made[0].calls}
        assert called == {CTL}, f"Mooncake called on {called}"
        assert lines(caplog, "remote tier up"), "no line when it came up"
        assert len(lines(caplog, "remote tier is down")) == 1
        assert tier.lookup(FP, make_keys("after", 2), 0.5) == 0
    finally:
        tier.close()
        join_closes(3.0)
        master.stop()
