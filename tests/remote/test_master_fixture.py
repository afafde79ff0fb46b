"""The mooncake_master fixture against a real master and a real client."""

from __future__ import annotations

import contextlib
import importlib
import os
import time

import pytest

from tests.support import mooncake as support

SEGMENT_BYTES = 64 << 20
LOCAL_BUFFER_BYTES = 16 << 20
MISSING = -704  # get_size() of a key the master does not know (OBJECT_NOT_FOUND)


@contextlib.contextmanager
def store_client(master):
    """A MooncakeDistributedStore set up against master, closed on exit (which
    takes 1-2 s, hence one client per test)."""
    # Imported here, not at the top: collection must survive a missing library
    # (the fixture then skips). By name, as the wheel ships no type stubs.
    store = importlib.import_module("mooncake.store")
    client = store.MooncakeDistributedStore()
    rc = client.setup(
        "127.0.0.1",
        "P2PHANDSHAKE",
        SEGMENT_BYTES,
        LOCAL_BUFFER_BYTES,
        "tcp",
        "",
        master.address,
    )
    assert rc == 0, f"setup against {master} returned {rc}\n{master.log_tail()}"
    try:
        yield client
    finally:
        assert client.close() == 0


def pid_exists(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_master_comes_up_healthy(mooncake_master):
    assert mooncake_master.running
    assert mooncake_master.healthy()
    assert pid_exists(mooncake_master.pid)
    assert mooncake_master.address == f"127.0.0.1:{mooncake_master.rpc_port}"
    assert mooncake_master.rpc_port != mooncake_master.metrics_port


def test_client_puts_and_gets_bytes(mooncake_master):
    value = os.urandom(256 << 10)
    with store_client(mooncake_master) as client:
        assert client.put("block-0", value) == 0
        assert client.get_size("block-0") == len(value)
        assert client.get("block-0") == value
        # a miss reads as empty bytes, and get_size() says why
        assert client.get("no-such-key") == b""
        assert client.get_size("no-such-key") == MISSING


def test_stop_kills_the_process(mooncake_master):
    pid = mooncake_master.pid
    mooncake_master.stop()
    assert not mooncake_master.running
    assert mooncake_master.pid is None
    assert not mooncake_master.healthy()
    assert not pid_exists(pid)  # killed and reaped, not a zombie
    mooncake_master.kill()  # idempotent


def test_restart_reuses_the_ports_and_clients_reconnect(mooncake_master):
    ports = (mooncake_master.rpc_port, mooncake_master.metrics_port)
    with store_client(mooncake_master) as client:
        assert client.put("before", b"old") == 0
        old_pid = mooncake_master.pid
        mooncake_master.restart()
        assert (mooncake_master.rpc_port, mooncake_master.metrics_port) == ports
        assert mooncake_master.healthy()
        assert mooncake_master.pid != old_pid
        assert not pid_exists(old_pid)
        # The client re-mounts its segment with the new master on its own
        # (the first puts fail meanwhile); the new master knows no old keys.
        deadline = time.monotonic() + 10
        while client.put("after", b"new") != 0:
            assert time.monotonic() < deadline, mooncake_master.log_tail()
            time.sleep(0.2)
        assert client.get("after") == b"new"
        assert client.get_size("before") == MISSING


def test_start_fails_with_the_log_when_the_port_is_taken(tmp_path, mooncake_master):
    # the running master holds the RPC port
    rival = support.MooncakeMaster(tmp_path, rpc_port=mooncake_master.rpc_port)
    rival.START_ATTEMPTS = 2
    with pytest.raises(RuntimeError, match="in use"):
        rival.start()
    assert not rival.running
    assert mooncake_master.healthy()


def test_context_manager_stops_the_master(tmp_path):
    support.require_mooncake()
    with support.MooncakeMaster(tmp_path) as master:
        pid = master.pid
        assert master.healthy()
    assert not master.running
    assert not pid_exists(pid)


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        (
            "OSError: libibverbs.so.1: cannot open shared object file: "
            "No such file or directory",
            "apt-get install libibverbs1",
        ),
        ("ModuleNotFoundError: No module named 'mooncake'", "pip install"),
        ("ImportError: libnuma.so.1: cannot open shared object", "libnuma1"),
        ("SystemError: something else", "scripts/setup_env.sh"),
    ],
)
def test_import_failure_reason_names_the_fix(error, fix):
    reason = support.import_failure_reason(f"Traceback ...\n{error}\n")
    assert fix in reason
    assert "\n" not in reason


@pytest.mark.parametrize("ci", ["true", None])
def test_unavailable_fails_under_ci_and_skips_elsewhere(monkeypatch, ci):
    expected: type[BaseException]
    monkeypatch.setattr(support, "mooncake_unavailable", lambda: "no mooncake here")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
        expected = pytest.skip.Exception
    else:
        monkeypatch.setenv("CI", ci)
        expected = pytest.fail.Exception
    with pytest.raises(expected, match="no mooncake here"):
        support.require_mooncake()
