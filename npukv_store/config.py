"""StoreConfig: every knob of npukv_store, with units and defaults.

Runs in: any process. Pure data; no I/O except reading ``NPUKV_<KEY>`` environment
variables in :meth:`StoreConfig.from_extra_config`, the only place env is read.

Values come from vLLM's ``kv_connector_extra_config`` (a dict of strings, numbers
and bools) or from keyword arguments. Unknown keys and bad values raise one
:class:`~npukv_store.errors.ConfigError` that names the key, what was found and
what was expected.

Over 400 lines because it is the configuration reference: one dataclass
whose every field carries its unit, default and why (docs/configuration.md
is generated from it, :mod:`.config_reference`); splitting it would split
that reference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from npukv_store.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(value: object, *, key: str = "size") -> int:
    """Parse a byte size: an int, or a string such as ``"500GiB"``, ``"1.5TB"``.

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB powers of 1000.

    Raises:
        ConfigError: negative, garbled, or with an unknown unit.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: found bool {value!r}, expected a byte size")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: found {value}, expected a size >= 0 bytes")
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}: found {type(value).__name__} {value!r}, expected a byte size "
            "such as 4096 or '500GiB'"
        )
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"{key}: found {value!r}, expected a non-negative size such as "
            "'4096', '64MiB', '500GiB' or '1.5TB'"
        )
    number = float(match.group(1))
    size = number * _SIZE_UNITS[match.group(2).lower()]
    if not math.isfinite(size):
        raise ConfigError(f"{key}: found {value!r}, expected a finite size")
    return int(size)


def _parse_bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}: found {value!r}, expected true or false")


def _parse_number(value: object, key: str, kind: type[int] | type[float]) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: found bool {value!r}, expected a {kind.__name__}")
    try:
        return kind(cast(Any, value))
    except (TypeError, ValueError):
        raise ConfigError(
            f"{key}: found {value!r}, expected a {kind.__name__}"
        ) from None


def _parse_budget(value: object, capacity: int) -> int:
    """``write_budget`` in bytes per day: a byte size, or drive writes per
    day of ``capacity`` (``"0.5dwpd"``)."""
    if isinstance(value, str) and value.strip().lower().endswith("dwpd"):
        number = value.strip()[:-4].strip()
        try:
            dwpd = float(number)
        except ValueError:
            dwpd = -1.0
        if not math.isfinite(dwpd) or dwpd < 0:
            raise ConfigError(
                f"write_budget: found {value!r}, expected drive writes per day "
                "such as '0.5dwpd', or a byte size per day such as '2TB'"
            )
        return int(dwpd * capacity)
    try:
        return parse_size(value, key="write_budget")
    except ConfigError:
        raise ConfigError(
            f"write_budget: found {value!r}, expected a byte size per day such "
            "as '2TB', drive writes per day such as '0.5dwpd', or 0 (none)"
        ) from None


def _parse_shares(value: object, capacity: int) -> tuple[tuple[str, float | int], ...]:
    """``tenant_shares`` as ``((salt, fraction or bytes), ...)``, checked.

    A float (or a string with a decimal point) is a fraction of capacity, a
    string ending in ``%`` a percentage, anything else a byte size."""
    key = "tenant_shares"
    if isinstance(value, tuple):  # already parsed (dataclasses.replace)
        value = dict(value)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ConfigError(
                f"{key}: found {value!r}, expected a JSON object such as "
                '{"tenant-a": 0.3, "": "100GiB"}'
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key}: found {type(value).__name__} {value!r}, expected a mapping "
            "from cache_salt to a share (0.3, '30%' or '200GiB')"
        )
    shares: list[tuple[str, float | int]] = []
    used = 0.0
    for salt, share in value.items():
        if not isinstance(salt, str):
            raise ConfigError(f"{key}: found salt {salt!r}, expected a string")
        what = f"{key}[{salt!r}]"
        text = share.strip() if isinstance(share, str) else ""
        parsed: float | int
        if isinstance(share, float) or text.endswith("%") or "." in text:
            number = _parse_number(text.rstrip("%") or share, what, float)
            parsed = number / 100 if text.endswith("%") else number
            if not (math.isfinite(parsed) and 0 < parsed <= 1):
                raise ConfigError(
                    f"{what}: found {share!r}, expected a fraction in (0, 1], a "
                    "percentage or a byte size"
                )
            used += parsed
        else:
            parsed = parse_size(share, key=what)
            if parsed == 0:
                raise ConfigError(f"{what}: found 0, expected a share > 0")
            used += parsed / max(capacity, 1)
        shares.append((salt, parsed))
    if used > 1 + 1e-9:
        raise ConfigError(
            f"{key}: found shares adding up to {used:.0%} of capacity "
            f"({capacity} bytes), expected at most 100%"
        )
    return tuple(shares)


def _doc(
    text: str,
    *,
    section: str = "store",
    choices: tuple[str, ...] = (),
    unit: str = "",
) -> dict[str, object]:
    """One key's entry in the configuration reference.

    docs/guide/configuration.md is rendered from these entries
    (``python -m npukv_store.config_reference --write``), and a test fails when
    the committed page differs, so the field docs are the one place to say what
    a key does.

    Args:
        text: what the key does, its units and what each value means.
        section: the reference section: ``store`` (any store handle),
            ``connector`` (read by the vLLM connector only) or ``remote`` (the
            tier behind the local store).
        choices: the accepted strings, for a key that takes one of them (the
            reference's test checks that ``__post_init__`` accepts exactly these).
        unit: what a number counts; ``bytes`` marks a size, given as an int or a
            string such as ``64MiB``.
    """
    return {"doc": text, "section": section, "choices": choices, "unit": unit}


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Configuration of one store handle (and, through vLLM, of the connector).

    Cross-process facts (format version, namespace) are not settings: they live in
    the directory marker and the chunk metadata and are checked on open.
    """

    cache_dir: str = field(
        metadata=_doc(
            "Cache directory shared by all processes (servers, TP ranks, the "
            "maintenance job), created at the first open. A non-empty directory "
            "without the cache's marker is refused (docs/decisions/0007)."
        )
    )
    capacity: int = field(
        default=parse_size("500GiB"),
        metadata=_doc(
            "Bytes of chunk files allowed in cache_dir, for all processes "
            "together: a commit that needs room evicts the least recently used "
            "chunks. Sizing it: docs/guide/operations.md.",
            unit="bytes",
        ),
    )
    admission: str = field(
        default="auto",
        metadata=_doc(
            "Which of the blocks a save brings are written. all: every block "
            "not stored. second_sight: a block the second time a save brings "
            "it (the first time it is remembered in a bounded ghost). auto: "
            "write-all while the shadows of both, kept on a sample of the "
            "blocks lookups ask for, warm up, then write-all only while each "
            "write it adds over second sight brings 0.1 hit more, else "
            "second sight. Saves stay prefix-closed; a declined block is a "
            "miss, never wrong KV. Choosing: docs/guide/operations.md "
            "(docs/decisions/0069).",
            choices=("auto", "all", "second_sight"),
        ),
    )
    write_budget: int = field(
        default=0,
        metadata=_doc(
            "Bytes the directory may write per day, all processes together, "
            "as a size ('2TB') or in drive writes per day of capacity "
            "('0.5dwpd'); 0: no budget. Under half of an hour's budget left, "
            "admission is second_sight whatever `admission` says; with none "
            "left, saves are declined until it refills.",
            unit="bytes per day",
        ),
    )
    tenant_shares: tuple[tuple[str, float | int], ...] = field(
        default=(),
        metadata=_doc(
            "Capacity reserved per tenant: a mapping from a request's "
            "cache_salt to its share, a fraction of capacity (0.3 or '30%') "
            "or a byte size ('200GiB'); the salt \"\" is requests without "
            "one. Eviction takes from tenants over their share first, and "
            "never evicts a tenant under its share for another tenant's "
            "saves; unlisted tenants have a share of 0. Shares add up to at "
            "most capacity. Empty (default): one LRU for all. Files and "
            "metrics name a tenant by a keyed digest of its salt, never the "
            "salt (docs/guide/tenants-and-pins.md).",
            unit="shares",
        ),
    )
    ring_size: int = field(
        default=0,
        metadata=_doc(
            "Bytes of the shared-memory staging ring per worker process (per "
            "store handle that saves with put_async), in /dev/shm, which is "
            "RAM. A full ring drops a save and counts it; a save never waits. "
            "0 (auto): what two steps stage (max_num_batched_tokens x the "
            "worker's bytes per token), within [64MiB, 4GiB], or 1GiB outside "
            "vLLM; where /dev/shm cannot hold that, a smaller ring and one "
            "warning line saying what to set. A size set here is made as it "
            "is or refused with one error. `npukv plan` prints the auto size "
            "(docs/decisions/0062; sizing: docs/guide/operations.md).",
            unit="bytes",
        ),
    )
    chunk_target_size: int = field(
        default=parse_size("64MiB"),
        metadata=_doc(
            "Bytes a chunk file aims for; saves are batched up to it.", unit="bytes"
        ),
    )
    io_engine: str = field(
        default="auto",
        metadata=_doc(
            "I/O backend: auto (io_uring where the kernel allows it, else "
            "threads), uring or threads.",
            choices=("auto", "uring", "threads"),
        ),
    )
    io_queue_depth: int = field(
        default=16,
        metadata=_doc(
            "I/O requests kept in flight per reader thread, and by the writer "
            "(1 to 4096).",
            unit="requests",
        ),
    )
    direct_io: bool = field(
        default=True,
        metadata=_doc(
            "O_DIRECT for chunk writes from the staging ring, and for first reads "
            "of uncached chunks into page-aligned buffers; a second read is "
            "buffered and admits the chunk to the page cache (docs/decisions/0012)."
        ),
    )
    fsync: str = field(
        default="chunk",
        metadata=_doc(
            "chunk: fsync each chunk file before the rename that publishes it, "
            "then its directory, and sync each index commit; never: no fsync "
            "(a process crash is still safe, a power loss may lose chunks in "
            "flight or the index; docs/guide/operations.md).",
            choices=("chunk", "never"),
        ),
    )
    verify: str = field(
        default="always",
        metadata=_doc(
            "always: check block checksums on every read; never: trust disk.",
            choices=("always", "never"),
        ),
    )
    layerwise: str = field(
        default="auto",
        metadata=_doc(
            "Per-layer save and load: on, off, or auto, which starts in bulk and "
            "turns layerwise once it has seen vLLM call the layer hooks for "
            "every layer; on the CPU, where nothing overlaps, auto stays in bulk "
            "(docs/decisions/0034).",
            section="connector",
            choices=("auto", "on", "off"),
        ),
    )
    prefetch_depth: int = field(
        default=2,
        metadata=_doc(
            "Layers whose reads run at once, ahead of the layer being computed "
            "(layerwise loads; docs/decisions/0043).",
            section="connector",
            unit="layers",
        ),
    )
    save_decode: bool = field(
        default=False,
        metadata=_doc(
            "Also save the blocks generated during decode, each in the step that "
            "fills it.",
            section="connector",
        ),
    )
    load_without_prefix_caching: bool = field(
        default=False,
        metadata=_doc(
            "Load hits even where vLLM runs with prefix caching off. vLLM turns "
            "it off where the attention backend cannot reuse context (e.g. MLA "
            "on the CPU, whose prefill and decode paths disagree), and a load "
            "would then change the output; only set this for a backend known "
            "to compute a continued prefill exactly as a full one "
            "(docs/decisions/0039).",
            section="connector",
        ),
    )
    load_policy: str = field(
        default="auto",
        metadata=_doc(
            "Which hits are loaded. auto: only the part of a hit whose load the "
            "measured bandwidth says finishes within (1 + load_margin) times its "
            "recompute at the measured prefill speed: all of it, its "
            "page-cached head, or none (recomputed instead); every hit until 4 "
            "loads and 8 steps are measured, and one probe every 5 s while "
            "declining. always: every hit. A declined hit is recomputed: this "
            "changes time, never outputs (docs/decisions/0024).",
            section="connector",
            choices=("auto", "always"),
        ),
    )
    load_margin: float = field(
        default=0.25,
        metadata=_doc(
            "auto: a hit is still loaded when its load is expected to take up "
            "to this much longer than its recompute (a load frees compute for "
            "the other requests of the batch; estimates are noisy).",
            section="connector",
            unit="ratio",
        ),
    )
    kv_events_medium: str = field(
        default="STORAGE",
        metadata=_doc(
            "The medium of this tier's KV cache events (BlockStored and "
            "BlockRemoved, published with vLLM's own where --kv-events-config "
            "is set). STORAGE is vLLM's own name for a disk tier (its "
            "offloading connectors use it), so routers that weigh vLLM's "
            "mediums need no new entry; any other name may be given "
            "(docs/metrics.md, KV events).",
            section="connector",
        ),
    )
    sliding_save: str = field(
        default="all",
        metadata=_doc(
            "Blocks of a sliding-window KV cache group that are saved: all "
            "(any prefix of a stored prompt is a hit) or tails (only the window "
            "before each prompt's end and before each shared-prefix junction: "
            "44% fewer bytes for a tiny Gemma3's 1,000-token prompt, far more "
            "for long prompts, but a prefix shared at a new point misses once; "
            "docs/decisions/0040).",
            section="connector",
            choices=("all", "tails"),
        ),
    )
    namespace_extra: str = field(
        default="", metadata=_doc("String mixed into the namespace fingerprint.")
    )
    index_map_size: int = field(
        default=parse_size("8GiB"),
        metadata=_doc(
            "Bytes of address space reserved for the LMDB index (sparse; at "
            "least 1MiB). The index file records the largest any process "
            "used, and the maintenance job opens it with that (`npukv plan` "
            "estimates the index's size).",
            unit="bytes",
        ),
    )
    evict_grace_s: float = field(
        default=5.0,
        metadata=_doc(
            "Seconds after its last use during which an evicted chunk keeps its "
            "file: a commit takes victims in LRU order whatever their age, and "
            "a victim used within this grace leaves the index at once but is "
            "unlinked only once the grace since its last use is over (a reader "
            "that located it still reads it). At most capacity/16 bytes wait "
            "so (beyond: unlinked at once, a reader then misses and "
            "recomputes), so the disk holds up to capacity * 17/16 of chunk "
            "files. The maintenance job's eviction to a target spares such "
            "chunks. docs/decisions/0070.",
            unit="seconds",
        ),
    )
    tmp_max_age_s: float = field(
        default=3600.0,
        metadata=_doc(
            "Seconds after which a tmp/ file is garbage even if its pid lives.",
            unit="seconds",
        ),
    )
    cache_group: str = field(
        default="",
        metadata=_doc(
            "Share the cache with one group: its name or gid. Empty (the default) "
            "keeps the cache private to its owner: directories 0700, files 0600. "
            "With a group, directories are 2770 (setgid) and files 0660, owned "
            "by that group. Never world bits (docs/security.md)."
        ),
    )
    lock_timeout_s: float = field(
        default=30.0,
        metadata=_doc(
            "Seconds an open waits for the cache directory's lock (recovery, "
            "index rebuilds) before it fails with one error naming the holder.",
            unit="seconds",
        ),
    )

    remote_store: str = field(
        default="none",
        metadata=_doc(
            "The tier behind the local store: none, or mooncake (Mooncake Store, "
            "shared by the nodes that name the same mooncake_master; "
            "docs/guide/remote-tier.md, docs/decisions/0055).",
            section="remote",
            choices=("none", "mooncake"),
        ),
    )
    mooncake_master: str = field(
        default="",
        metadata=_doc(
            "HOST:PORT of mooncake_master's RPC; required with remote_store: "
            "mooncake. Name it by an address every node uses, never 127.0.0.1 "
            "on the master's own node when other nodes join.",
            section="remote",
        ),
    )
    mooncake_metadata: str = field(
        default="P2PHANDSHAKE",
        metadata=_doc(
            "Mooncake's metadata server: P2PHANDSHAKE (none needed), or a URL "
            "such as http://HOST:PORT/metadata.",
            section="remote",
        ),
    )
    mooncake_protocol: str = field(
        default="tcp",
        metadata=_doc(
            "Mooncake transfer protocol: tcp, rdma or ascend (rdma and ascend "
            "untested here).",
            section="remote",
            choices=("tcp", "rdma", "ascend"),
        ),
    )
    mooncake_device: str = field(
        default="",
        metadata=_doc(
            "RDMA devices for protocol rdma (e.g. mlx5_0,mlx5_1); empty: "
            "Mooncake's choice.",
            section="remote",
        ),
    )
    mooncake_segment_size: int = field(
        default=parse_size("1GiB"),
        metadata=_doc(
            "Bytes of host memory this process contributes to Mooncake's pool: "
            "0 (none; values then live in other processes' segments) or at "
            "least 16MiB. Every process with the tier lends one: the EngineCore "
            "and each worker process (docs/caveats.md).",
            section="remote",
            unit="bytes",
        ),
    )
    mooncake_local_buffer: int = field(
        default=parse_size("64MiB"),
        metadata=_doc(
            "Bytes of Mooncake's own transfer buffer in this process (at least 1MiB).",
            section="remote",
            unit="bytes",
        ),
    )
    remote_timeout_ms: float = field(
        default=20.0,
        metadata=_doc(
            "The longest a scheduler step waits for the remote tier's lookups, "
            "all of them together, in (0, 60000]. A request whose answer is not "
            "back is asked again in the next step, for up to 3 steps, and then "
            "served with its local hit only.",
            section="remote",
            unit="milliseconds",
        ),
    )
    remote_promote: bool = field(
        default=True,
        metadata=_doc(
            "Write blocks loaded from the remote tier into the local store, so "
            "that the next hit on them is local.",
            section="remote",
        ),
    )
    remote_secret_file: str = field(
        default="",
        metadata=_doc(
            "A file (0600, at least 32 bytes) holding the secret shared by the "
            "nodes of one remote tier: it keys the block chains, the remote key "
            "names and the MAC of every remote value (docs/security.md). "
            "Required with remote_store unless remote_insecure is true.",
            section="remote",
        ),
    )
    remote_insecure: bool = field(
        default=False,
        metadata=_doc(
            "Run the remote tier without a secret: any host that reaches "
            "Mooncake can then read, forge and remove KV (docs/decisions/0058).",
            section="remote",
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.cache_dir, str | os.PathLike) or not str(self.cache_dir):
            raise ConfigError(
                f"cache_dir: found {self.cache_dir!r}, expected a directory path"
            )
        object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        for key in ("capacity", "ring_size", "chunk_target_size", "index_map_size"):
            object.__setattr__(self, key, parse_size(getattr(self, key), key=key))
        object.__setattr__(
            self, "tenant_shares", _parse_shares(self.tenant_shares, self.capacity)
        )
        self._check_choice("admission", ("auto", "all", "second_sight"))
        object.__setattr__(
            self, "write_budget", _parse_budget(self.write_budget, self.capacity)
        )
        self._check_choice("io_engine", ("auto", "uring", "threads"))
        self._check_choice("fsync", ("chunk", "never"))
        self._check_choice("verify", ("always", "never"))
        self._check_choice("layerwise", ("auto", "on", "off"))
        self._check_choice("sliding_save", ("all", "tails"))
        medium = self.kv_events_medium
        if not isinstance(medium, str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,32}", medium
        ):
            raise ConfigError(
                f"kv_events_medium: found {medium!r}, expected a name of 1 to 32 "
                "letters, digits, '_', '.' or '-' (e.g. STORAGE, NVME)"
            )
        self._check_choice("load_policy", ("auto", "always"))
        margin = _parse_number(self.load_margin, "load_margin", float)
        if not math.isfinite(margin) or margin < 0:
            raise ConfigError(f"load_margin: found {margin}, expected a ratio >= 0")
        object.__setattr__(self, "load_margin", margin)
        for key in ("direct_io", "save_decode", "load_without_prefix_caching"):
            object.__setattr__(self, key, _parse_bool(getattr(self, key), key))
        depth = _parse_number(self.prefetch_depth, "prefetch_depth", int)
        if depth < 1:
            raise ConfigError(f"prefetch_depth: found {depth}, expected >= 1 layers")
        object.__setattr__(self, "prefetch_depth", depth)
        queue_depth = _parse_number(self.io_queue_depth, "io_queue_depth", int)
        if not 1 <= queue_depth <= 4096:
            raise ConfigError(
                f"io_queue_depth: found {queue_depth}, expected 1..4096 requests"
            )
        object.__setattr__(self, "io_queue_depth", queue_depth)
        for key in ("evict_grace_s", "tmp_max_age_s", "lock_timeout_s"):
            seconds = _parse_number(getattr(self, key), key, float)
            if not math.isfinite(seconds) or seconds < 0:
                raise ConfigError(f"{key}: found {seconds}, expected seconds >= 0")
            object.__setattr__(self, key, seconds)
        if not isinstance(self.cache_group, str):
            raise ConfigError(
                f"cache_group: found {self.cache_group!r}, expected a group name or gid"
            )
        object.__setattr__(self, "cache_group", self.cache_group.strip())
        if not isinstance(self.namespace_extra, str):
            raise ConfigError(
                f"namespace_extra: found {self.namespace_extra!r}, expected a string"
            )
        self._check_remote()
        if self.index_map_size < (1 << 20):
            raise ConfigError(
                f"index_map_size: found {self.index_map_size} bytes, expected >= 1MiB"
            )

    def _check_remote(self) -> None:
        self._check_choice("remote_store", ("none", "mooncake"))
        self._check_choice("mooncake_protocol", ("tcp", "rdma", "ascend"))
        for key in ("mooncake_segment_size", "mooncake_local_buffer"):
            object.__setattr__(self, key, parse_size(getattr(self, key), key=key))
        if 0 < self.mooncake_segment_size < (16 << 20):
            # Mooncake's setup refuses it (-600) and the tier would retry forever
            raise ConfigError(
                f"mooncake_segment_size: found {self.mooncake_segment_size} bytes, "
                "expected 0 or >= 16MiB"
            )
        for key in ("remote_promote", "remote_insecure"):
            object.__setattr__(self, key, _parse_bool(getattr(self, key), key))
        if not isinstance(self.remote_secret_file, str):
            raise ConfigError(
                f"remote_secret_file: found {self.remote_secret_file!r}, expected "
                "a file path"
            )
        timeout = _parse_number(self.remote_timeout_ms, "remote_timeout_ms", float)
        if not math.isfinite(timeout) or not 0 < timeout <= 60_000:
            raise ConfigError(
                f"remote_timeout_ms: found {timeout}, expected milliseconds in "
                "(0, 60000]"
            )
        object.__setattr__(self, "remote_timeout_ms", timeout)
        for key in ("mooncake_master", "mooncake_metadata", "mooncake_device"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(
                    f"{key}: found {getattr(self, key)!r}, expected a string"
                )
        master = self.mooncake_master.strip()
        host, _, port = master.rpartition(":")
        needed = self.remote_store == "mooncake" or master
        if needed and (not host or not port.isdigit() or not 0 < int(port) < 65536):
            raise ConfigError(
                f"mooncake_master: found {self.mooncake_master!r}, expected "
                "HOST:PORT of mooncake_master's RPC (e.g. 10.0.0.5:50051)"
            )
        object.__setattr__(self, "mooncake_master", master)
        metadata = self.mooncake_metadata.strip()
        if metadata != "P2PHANDSHAKE" and not re.match(r"^[a-z]+://\S+$", metadata):
            raise ConfigError(
                f"mooncake_metadata: found {self.mooncake_metadata!r}, expected "
                "P2PHANDSHAKE or a metadata server URL (http://HOST:PORT/metadata)"
            )
        object.__setattr__(self, "mooncake_metadata", metadata)
        if self.mooncake_local_buffer < (1 << 20):
            raise ConfigError(
                f"mooncake_local_buffer: found {self.mooncake_local_buffer} bytes, "
                "expected >= 1MiB"
            )

    def _check_choice(self, key: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, key)
        normalised = value.strip().lower() if isinstance(value, str) else value
        if normalised not in choices:
            raise ConfigError(
                f"{key}: found {value!r}, expected one of {', '.join(choices)}"
            )
        object.__setattr__(self, key, normalised)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """All accepted configuration keys, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object], env: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """Build a config from vLLM's ``kv_connector_extra_config``.

        Args:
            extra: key -> value; every key must be a StoreConfig field.
            env: environment to read ``NPUKV_<KEY>`` overrides from (default
                ``os.environ``); an override wins over ``extra``.

        Raises:
            ConfigError: an unknown key, a missing ``cache_dir`` or a bad value.
        """
        known = cls.keys()
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, unknown))}; "
                f"expected some of {', '.join(known)}"
            )
        values: dict[str, object] = dict(extra)
        env = os.environ if env is None else env
        for key in known:
            override = env.get(f"NPUKV_{key.upper()}")
            if override is not None:
                values[key] = override
        if "cache_dir" not in values:
            raise ConfigError("cache_dir: missing, expected a directory path")
        return cls(**values)  # type: ignore[arg-type]
