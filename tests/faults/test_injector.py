"""The fault injector itself (npukv_store/testing/faults.py) and the suite's
bookkeeping: the rules do what the spec says, make_engine wraps only when
NPUKV_FAULTS is set, and docs/faults.md lists every registered kind."""

from __future__ import annotations

import errno
import os
import re
import threading
from pathlib import Path

import pytest

from npukv_store import ConfigError
from npukv_store.io.engine import READ, WRITE, IORequest, make_engine
from npukv_store.io.threads import ThreadEngine
from npukv_store.testing import faults as io_faults
from tests.faults.kinds import register_all

DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 256)  # 64 KiB
    fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


def _reads(fd: int, n: int, size: int = 16384) -> list[IORequest]:
    return [
        IORequest(READ, fd, i * size, memoryview(bytearray(size)), i) for i in range(n)
    ]


def _results(engine, requests) -> dict[int, int]:
    return {c.tag: c.result for c in engine.run(requests)}


def test_parse_faults_reads_every_field():
    rules = io_faults.parse_faults(
        "read:eio:p=0.5:seed=3; write:enospc:after=2:count=1;any:slow:ms=5"
    )
    assert [(r.op, r.kind) for r in rules] == [
        ("read", "eio"), ("write", "enospc"), ("any", "slow"),
    ]  # fmt: skip
    assert (rules[0].p, rules[0].seed) == (0.5, 3)
    assert (rules[1].after, rules[1].count) == (2, 1)
    assert rules[2].ms == 5.0


@pytest.mark.parametrize(
    "spec", ["read", "read:melt", "scan:eio", "read:eio:p=x", "read:eio:when=2"]
)
def test_a_bad_spec_is_one_clear_error(spec):
    with pytest.raises(ConfigError, match="NPUKV_FAULTS: found") as caught:
        io_faults.parse_faults(spec)
    assert "expected" in str(caught.value)


def test_eio_short_after_and_count(data_file):
    inner = ThreadEngine(4)
    rules = io_faults.parse_faults("read:eio:after=1:count=2")
    with io_faults.FaultyEngine(inner, rules) as engine:
        got = _results(engine, _reads(data_file, 4))
    assert got == {0: 16384, 1: -errno.EIO, 2: -errno.EIO, 3: 16384}
    assert (rules[0].matched, rules[0].injected) == (4, 2)
    with io_faults.FaultyEngine(
        ThreadEngine(4), io_faults.parse_faults("read:short")
    ) as engine:
        requests = _reads(data_file, 2)
        got = _results(engine, requests)
        tiny = _results(engine, _reads(data_file, 1, size=100))
    assert got == {0: 8192, 1: 8192}  # half, in whole pages
    assert bytes(requests[1].buffer[:8192]) == (bytes(range(256)) * 32)
    assert bytes(requests[1].buffer[8192:]) == bytes(8192)  # never read
    assert tiny == {0: 0}


def test_probability_and_writes(data_file):
    never = io_faults.parse_faults("read:eio:p=0")
    with io_faults.FaultyEngine(ThreadEngine(2), never) as engine:
        assert set(_results(engine, _reads(data_file, 4)).values()) == {16384}
    assert never[0].injected == 0
    some = io_faults.parse_faults("read:eio:p=0.5:seed=1")
    with io_faults.FaultyEngine(ThreadEngine(2), some) as engine:
        values = list(_results(engine, _reads(data_file, 32, size=2048)).values())
    assert 0 < values.count(-errno.EIO) < 32
    write = IORequest(WRITE, data_file, 0, memoryview(b"x" * 4096), 7)
    rules = io_faults.parse_faults("write:enospc")
    with io_faults.FaultyEngine(ThreadEngine(2), rules) as engine:
        assert _results(engine, [write]) == {7: -errno.ENOSPC}
        assert set(_results(engine, _reads(data_file, 2)).values()) == {16384}


def test_slow_delays_the_submitting_thread(data_file, monkeypatch):
    slept: list[tuple[float, str]] = []

    class _Time:  # the engine's clock, recording its sleeps instead
        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append((seconds, threading.current_thread().name))

    monkeypatch.setattr(io_faults, "time", _Time())
    rules = io_faults.parse_faults("read:slow:ms=60")
    with io_faults.FaultyEngine(ThreadEngine(2), rules) as engine:
        assert set(_results(engine, _reads(data_file, 2)).values()) == {16384}
    # each request held 60 ms, in the thread that submitted it
    assert slept == [(0.06, threading.current_thread().name)] * 2


def test_make_engine_wraps_only_when_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(io_faults.ENV, raising=False)
    with make_engine("threads", 2) as plain:
        assert type(plain) is ThreadEngine
    monkeypatch.setenv(io_faults.ENV, "read:eio")
    io_faults.forget_env_faults()
    with make_engine("threads", 2) as wrapped, make_engine("threads", 2) as other:
        assert isinstance(wrapped, io_faults.FaultyEngine)
        assert wrapped.kind == "faulty-threads"
        assert wrapped.rules[0] is other.rules[0]  # one set of counters a process
    monkeypatch.setenv(io_faults.ENV, "read:nonsense")
    io_faults.forget_env_faults()
    with pytest.raises(ConfigError, match="NPUKV_FAULTS"):
        make_engine("threads", 2)
    io_faults.forget_env_faults()


def test_docs_list_every_kind_with_its_promise():
    kinds = register_all()
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| (P[1-4]) \|", text, re.M))
    missing = {k: v.promise for k, v in kinds.items() if rows.get(k) != v.promise}
    assert not missing, (
        f"docs/faults.md lacks or misstates {missing}: regenerate its table with "
        "python -m tests.faults.kinds"
    )
    assert set(rows) <= set(kinds), set(rows) - set(kinds)
    assert len(kinds) >= 30
