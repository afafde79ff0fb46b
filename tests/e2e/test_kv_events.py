"""KV cache events of the NVMe tier on real vLLM (CPU build): vLLM publishes
them with its own on a ZeroMQ socket (``--kv-events-config``), and a
subscriber here decodes them with vLLM's own msgpack decoder, as a KV-aware
router does (docs/guide/events.md).

One process, prompts A, B, C: A is saved; while B runs, A's blocks appear
with this tier's medium, under the very hashes of vLLM's own events for A;
then the maintenance job evicts everything (another process), and while C
runs, A's blocks are withdrawn. ``pytest -k kv_event`` runs every events test.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.harness.runs import build_model, finish, start

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
zmq = pytest.importorskip("zmq", reason="vLLM's event publisher needs pyzmq")
pytestmark = pytest.mark.e2e

from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

MEDIUM = "STORAGE"


class Subscriber:
    """Collects every event batch published to it (topic 'kv'). It binds
    ``endpoint``: vLLM's publisher connects to a tcp endpoint that names a
    host (and binds only a wildcard one), as a router's collector would."""

    def __init__(self) -> None:
        import msgspec

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        port = self._sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.events += self._decoder.decode(payload).events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()


def _gate(gates: Path, name: str, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not (gates / name).exists():
        assert proc.poll() is None, f"the vLLM run ended before {name}"
        assert time.monotonic() < deadline, f"no {name} within {timeout_s} s"
        time.sleep(0.1)


def _stored(events, medium):
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def test_kv_events_announce_saved_blocks_under_vllms_hashes_and_withdraw_evicted(
    tmp_path,
):
    model = build_model(tmp_path / "model", "llama")
    rng = random.Random(11)
    a, b, c = ([rng.randrange(4, 2999) for _ in range(200)] for _ in range(3))
    gates, cache = tmp_path / "gates", tmp_path / "cache"
    gates.mkdir()
    sub = Subscriber()
    endpoint = sub.endpoint
    proc = start(
        tmp_path, "events", [a, b, c], model=model, cache_dir=cache,
        args=("--kv-events-endpoint", endpoint, "--pause-after-warmup", str(gates),
              "--pause-before", "2", "--max-tokens", "16"),
    )  # fmt: skip
    try:
        _gate(gates, "ready", proc)
        time.sleep(1.0)  # the subscriber has joined before A's events
        (gates / "go").touch()
        _gate(gates, "before-2", proc)  # A saved and announced while B ran
        time.sleep(0.5)
        before_eviction = list(sub.events)
        evicted = subprocess.run(
            [sys.executable, "-m", "npukv_store.cli", "compact", str(cache),
             "--target", "0", "--grace", "0"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert evicted.returncode in (0, 1), evicted.stderr
        (gates / "go-2").touch()
        _gate(gates, "done", proc)
        time.sleep(0.5)
        (gates / "exit").touch()
        report = finish(tmp_path, "events", proc)
    finally:
        sub.close()
    assert "connector is off" not in report["log"]
    ours = _stored(before_eviction, MEDIUM)
    assert ours, f"no {MEDIUM} events: {before_eviction[:5]}"
    vllms = [e for e in before_eviction if isinstance(e, BlockStored)]
    vllms = [e for e in vllms if e.medium != MEDIUM]
    vllm_hashes = {h for e in vllms for h in e.block_hashes}
    a_hashes = _hashes_of(vllms, a)
    assert len(a_hashes) == len(a) // 32  # A's full blocks, in vLLM's own events
    our_hashes = [h for e in ours for h in e.block_hashes]
    assert set(a_hashes) <= set(our_hashes), "A's blocks under vLLM's hashes"
    assert set(our_hashes) <= vllm_hashes  # nothing vLLM would not name so
    assert len(our_hashes) == len(set(our_hashes))  # each announced once
    gone = [
        h
        for e in sub.events[len(before_eviction) :]
        if isinstance(e, BlockRemoved) and e.medium == MEDIUM
        for h in e.block_hashes
    ]
    assert set(a_hashes) <= set(gone), "A's blocks were not withdrawn"
    assert len(gone) == len(set(gone))  # withdrawn once


def _hashes_of(events, tokens: list[int], block: int = 32) -> list:
    """The hashes vLLM's own events give the full blocks of ``tokens``."""
    mine = {
        tuple(tokens[j : j + block]) for j in range(0, len(tokens) - block + 1, block)
    }
    return [
        block_hash
        for event in events
        for i, block_hash in enumerate(event.block_hashes)
        if tuple(event.token_ids[i * block : (i + 1) * block]) in mine
    ]
