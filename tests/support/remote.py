"""The Mooncake tier tests' helpers (tests/remote, tests/security): a tier's
config and secret, block keys, waits, stores attached to a tier, the values a
node writes for block_tensors, Nodes, the tiers and stores a test makes (the
``nodes`` fixture, tests/remote/conftest.py), Recording (a real client whose
calls are recorded with their threads), and HangingClient, a fake Mooncake
client whose calls hang."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.harness.mooncake import secret_file as harness_secret_file
from npukv_store import KVStore, NamespaceSpec, StoreConfig
from npukv_store.hashing import namespace_fingerprint
from npukv_store.remote.tier import MooncakeTier
from npukv_store.remote.value import ValueLayout, encode_value
from tests.support.blocks import block_tensors, tiny_spec

SEGMENT = 64 << 20
LOCAL_BUFFER = "16MiB"


def secret_file(directory, name: str = "remote.secret") -> str:
    """``directory/name``: the tier's shared secret, made once (bench's)."""
    return harness_secret_file(Path(directory) / name)


def tier_config(address: str, cache_dir, segment: int = SEGMENT, **kw) -> StoreConfig:
    """A node's config; its secret is the test's (``remote.secret`` next to
    the cache dir, so every node of one test shares it) unless ``kw`` names
    one or remote_insecure."""
    if "remote_secret_file" not in kw and not kw.get("remote_insecure"):
        kw["remote_secret_file"] = secret_file(Path(cache_dir).parent)
    return StoreConfig(
        cache_dir=str(cache_dir),
        capacity="256MiB",
        ring_size="16MiB",
        remote_store="mooncake",
        mooncake_master=address,
        mooncake_segment_size=segment,
        mooncake_local_buffer=LOCAL_BUFFER,
        **kw,
    )


def make_keys(tag: str, count: int) -> list[bytes]:
    """Distinct 16-byte block keys, the same in every process for a tag."""
    return [
        hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()
        for i in range(count)
    ]


def wait_until(predicate: Callable[[], object], timeout_s: float, step=0.01) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def wait_up(tier: MooncakeTier, timeout_s: float = 10.0) -> MooncakeTier:
    assert wait_until(lambda: tier.up, timeout_s), (
        f"tier not up after {timeout_s} s: {tier.breaker.state} {tier.breaker.reason}"
    )
    return tier


def join_closes(timeout_s: float) -> None:
    """Wait for the Mooncake clients that tier.close() closes in the background."""
    end = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name == "npukv-remote-close":
            thread.join(max(0.0, end - time.monotonic()))


def attach(store: KVStore, tier: MooncakeTier) -> None:
    ring = store.ring_buffer()
    tier.register(ring.ctypes.data, ring.nbytes)
    store.attach_remote(tier)


def load_buffer(tier: MooncakeTier, layout: ValueLayout, count: int) -> np.ndarray:
    out = np.zeros((count, layout.value_bytes), np.uint8)
    tier.register(out.ctypes.data, out.nbytes)
    return out


def block_layers(spec: NamespaceSpec, tensors, row: int) -> list[bytes]:
    """Block ``row``'s bytes of each layer (its parts in file order)."""
    return [
        b"".join(
            np.ascontiguousarray(tensors[f"{layer.name}.{part.name}"][row]).tobytes()
            for part in layer.parts
        )
        for layer in spec.layers
    ]


def expected_values(
    spec: NamespaceSpec, keys: Sequence[bytes], mac_key: bytes
) -> np.ndarray:
    """The values a node (of MAC key ``mac_key``: ``tier.keys.mac_key``) that
    put block_tensors(spec, keys) wrote, exactly."""
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    tensors = block_tensors(spec, list(keys))
    return np.stack(
        [
            np.frombuffer(
                encode_value(
                    layout, fingerprint, key, block_layers(spec, tensors, i),
                    mac_key=mac_key,
                ),
                np.uint8,
            )
            for i, key in enumerate(keys)
        ]
    )  # fmt: skip


def assert_layers_equal(spec: NamespaceSpec, out: np.ndarray, keys, rows) -> None:
    """Every layer's bytes of ``out[rows]`` equal the tensors put for ``keys``."""
    layout = ValueLayout.for_spec(spec)
    tensors = block_tensors(spec, list(keys))
    for row in rows:
        for index, layer in enumerate(spec.layers):
            offset = layout.layer_offset(index)
            for part in layer.parts:
                want = tensors[f"{layer.name}.{part.name}"][row].view(np.uint8)
                got = out[row, offset : offset + part.row_bytes]
                assert np.array_equal(got, want.reshape(-1)), (row, layer.name, part)
                offset += part.row_bytes


def big_spec(model: str = "big", num_layers: int = 4) -> NamespaceSpec:
    """Layers of k/v F16 [16, 8, 64]: 32 KiB per layer, 128 KiB per block."""
    return tiny_spec(num_layers, model, row_shape=(16, 8, 64))


class Nodes:
    """Tiers (and stores) made by a test, closed at its end, before the master
    stops: each one is a Mooncake client, so a test makes one or two."""

    def __init__(self, master, tmp_path) -> None:
        self.master = master
        self.tmp_path = tmp_path
        self.tiers: list[MooncakeTier] = []
        self.stores: list[KVStore] = []

    def tier(
        self, segment: int = SEGMENT, name: str | None = None, **kw
    ) -> MooncakeTier:
        """A tier on the master, up; ``kw``: config keys (another
        remote_secret_file, remote_insecure)."""
        name = name or f"node{len(self.tiers)}"
        config = tier_config(self.master.address, self.tmp_path / name, segment, **kw)
        tier = MooncakeTier(config)
        self.tiers.append(tier)
        return wait_up(tier)

    def store(self, tier: MooncakeTier, spec: NamespaceSpec, cache_dir=None) -> KVStore:
        """A store (on the tier's cache_dir by default) that writes through to it."""
        config = tier.config
        if cache_dir is not None:
            config = tier_config(
                self.master.address, cache_dir, 0,
                remote_secret_file=config.remote_secret_file,
                remote_insecure=config.remote_insecure,
            )  # fmt: skip
        store = KVStore(config, spec)
        self.stores.append(store)
        attach(store, tier)
        return store

    def close(self) -> None:
        for store in self.stores:
            store.close()
        if not self.master.running:
            # Mooncake's close() holds the GIL throughout: 1-2 s with a
            # master, about 20 s without one (measured), the whole process
            # frozen; with a fresh master (empty) it is the short kind
            self.master.start()
        for tier in self.tiers:
            tier.close()
        join_closes(5.0)  # none is left running into the next test


def put_through(store: KVStore, keys: Sequence[bytes], batch: int = 16) -> None:
    spec = store.spec
    for begin in range(0, len(keys), batch):
        part = list(keys[begin : begin + batch])
        result = store.put_async(part, block_tensors(spec, part))
        assert result.queued == len(part), result
        assert store.flush(10.0)


class Recording:
    """A tier's real client, each call to the master recorded as (name,
    thread name); registering memory is local bookkeeping, not recorded."""

    def __init__(self, client) -> None:
        self._client = client
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr) or name.endswith("register_buffer"):
            return attr

        def call(*args, **kw):
            self.calls.append((name, threading.current_thread().name))
            return attr(*args, **kw)

        return call

    def sent(self, *names: str) -> int:
        return sum(1 for name, _ in self.calls if name in names)


class HangingClient:
    """A fake Mooncake client: lookups and loads hang for ``hang_s`` (until
    ``released`` is set), the rest answers at once (``get_size``: not found,
    so the breaker's health probes succeed). ``inside``: how many calls are
    hanging in it now (a caller that returned while it is non-zero did not
    wait for them); ``threads``: the name of each thread that called it."""

    def __init__(self, hang_s: float = 3.0, setup_s: float = 0.0, setup_rc: int = 0):
        self.hang_s = hang_s
        self.setup_s = setup_s
        self.setup_rc = setup_rc
        self.released = threading.Event()
        self.setups = 0
        self.exists = 0
        self.gets = 0
        self.sizes = 0
        self.inside = 0
        self.threads: list[str] = []
        self._inside_lock = threading.Lock()

    def _hang(self, seconds: float) -> None:
        self.threads.append(threading.current_thread().name)
        with self._inside_lock:
            self.inside += 1
        try:
            self.released.wait(seconds)
        finally:
            with self._inside_lock:
                self.inside -= 1

    def setup(self, *args) -> int:
        self.setups += 1
        self._hang(self.setup_s)
        return self.setup_rc

    def register_buffer(self, address: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, address: int) -> int:
        return 0

    def batch_is_exist(self, names):
        self.exists += 1
        self._hang(self.hang_s)
        return [1] * len(names)

    def batch_get_into(self, names, ptrs, sizes):
        self.gets += 1
        self._hang(self.hang_s)
        return [-704] * len(names)

    def get_size(self, name) -> int:
        self.sizes += 1
        self.threads.append(threading.current_thread().name)
        return -704

    def batch_put_from(self, names, ptrs, sizes):
        return [0] * len(names)

    def close(self) -> int:
        return 0


def fake_config(cache_dir, **kw) -> StoreConfig:
    """A config for a tier over a fake client (the master is never dialled)."""
    kw.setdefault("remote_secret_file", secret_file(Path(cache_dir).parent))
    return StoreConfig(
        cache_dir=str(cache_dir),
        remote_store="mooncake",
        mooncake_master="127.0.0.1:9",
        **kw,
    )
