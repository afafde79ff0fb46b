"""The reports of the ``npukv`` command (:mod:`npukv_store.cli`), built from a
cache directory as the ``--json`` objects (:mod:`.render` prints them as text).

Runs in: the ``npukv`` process; reads only (index snapshots, file headers).

    stats_report()     - capacity, used, live and dead bytes, namespaces,
                         tenants, pins, admission
    admission_report() - the directory's admission state and counters
    namespace_report() - one namespace: spec, layout, usage
    chunk_report()     - one chunk file: header, tensors, live rows
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from npukv_store.cli.pins import pin_summary
from npukv_store.spec import NamespaceSpec
from npukv_store.store import calibration, policy
from npukv_store.store.admission import AdmissionTuning, Mode, Scores, choose_mode
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import META_CREATED_NS, META_CREATOR, ChunkHeader
from npukv_store.store.index import Index
from npukv_store.store.index_admission import COUNTERS as ADMISSION_COUNTERS
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.pins import PinRecord, decode_pins


@dataclass
class Usage:
    """What the index says a set of chunks holds."""

    chunks: int = 0
    blocks: int = 0
    bytes: int = 0
    dead_bytes: int = 0
    oldest_ns: int | None = None
    newest_ns: int | None = None

    def add(self, record: ChunkRecord) -> None:
        self.chunks += 1
        self.blocks += record.live_rows
        self.bytes += record.size_bytes
        # about what compaction gets back by rewriting only the live rows
        self.dead_bytes += policy.dead_bytes(record)
        created = record.created_ns
        self.oldest_ns = min(created, self.oldest_ns or created)
        self.newest_ns = max(created, self.newest_ns or created)

    def as_dict(self) -> dict[str, int | None]:
        return {
            "chunks": self.chunks,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "dead_bytes": self.dead_bytes,
            "oldest_ns": self.oldest_ns,
            "newest_ns": self.newest_ns,
        }


def usage_by_namespace(
    cdir: CacheDir, index: Index, by_tenant: dict[str, Usage] | None = None
) -> tuple[dict[str, Usage], Usage]:
    """Per namespace (on disk or in the index) and overall, from one snapshot;
    per tenant too into ``by_tenant`` (its pinned chunks under ``"pinned"``)."""
    per_ns = {ns: Usage() for ns in cdir.namespaces()}
    total = Usage()
    for record in index.iter_chunks():
        per_ns.setdefault(record.namespace.hex(), Usage()).add(record)
        total.add(record)
        if by_tenant is not None:
            by_tenant.setdefault(record.tenant.hex(), Usage()).add(record)
            if record.pinned:
                by_tenant.setdefault("pinned", Usage()).add(record)
    return dict(sorted(per_ns.items())), total


def tenants_report(index: Index, by_tenant: dict[str, Usage]) -> dict[str, Any]:
    """Each tenant (the hex of its keyed digest: never its salt): bytes held
    by the ledger, its share, chunks and blocks, and its pinned bytes."""
    ledger, shares = index.tenants()
    names = {t.hex() for t in ledger} | {t.hex() for t in shares}
    names |= {t for t in by_tenant if t != "pinned"}
    report = {}
    for name in sorted(names):
        tenant = bytes.fromhex(name)
        usage = by_tenant.get(name, Usage())
        share = shares.get(tenant)
        held = ledger.get(tenant, 0)
        report[name] = {
            "bytes": held,
            "share_bytes": share,
            "over_share": held > (share or 0) if shares else None,
            "chunks": usage.chunks,
            "blocks": usage.blocks,
        }
    return report


def pins_report(index: Index) -> list[dict[str, Any]]:
    """Every pin: its id, label, tenant, tokens, the keys servers pinned for
    it (over every namespace), and when it expires."""
    now = time.time_ns()
    pins: list[dict[str, Any]] = []
    for pin_id, record in sorted(decode_pins(index.pin_records()).items()):
        if not isinstance(record, PinRecord):
            pins.append({"pin": pin_id.hex(), "error": str(record)})
            continue
        pins.append(
            {
                **pin_summary(record),
                "pinned_keys": index.pinned_keys(pin_id),
                "expired": record.expired(now),
            }
        )
    return pins


def read_spec(cdir: CacheDir, namespace: str) -> NamespaceSpec | None:
    """The spec in ``<ns>/namespace.json``; None when missing or unreadable."""
    try:
        with open(os.path.join(cdir.ns_dir(namespace), "namespace.json")) as handle:
            return NamespaceSpec.from_json(handle.read())
    except (OSError, ValueError):
        return None


def spec_fields(spec: NamespaceSpec | None) -> dict[str, Any]:
    if spec is None:
        return dict.fromkeys(("model", "dtype", "block_size", "tp_rank", "tp_size"))
    return {
        "model": spec.model,
        "dtype": spec.kv_dtype,
        "block_size": spec.block_size,
        "tp_rank": spec.tp_rank,
        "tp_size": spec.tp_size,
    }


def stats_report(cdir: CacheDir, index: Index, capacity: int | None) -> dict[str, Any]:
    """The ``npukv stats --json`` object (docs/cli.md, "Reading npukv stats")."""
    by_tenant: dict[str, Usage] = {}
    per_ns, total = usage_by_namespace(cdir, index, by_tenant)
    pinned = by_tenant.pop("pinned", Usage())
    default = os.path.join(cdir.root, "quarantine")
    quarantine = str(getattr(cdir, "quarantine_dir", default))
    quarantined = [e.stat().st_size for e in _scan(quarantine) if e.is_file()]
    report: dict[str, Any] = {
        "cache_dir": cdir.root,
        "capacity_bytes": capacity,
        "used_bytes": total.bytes,
        "live_bytes": total.bytes - total.dead_bytes,
        "dead_bytes": total.dead_bytes,
        "fragmentation": total.dead_bytes / total.bytes if total.bytes else 0.0,
        "chunks": total.chunks,
        "blocks": total.blocks,
        "oldest_ns": total.oldest_ns,
        "newest_ns": total.newest_ns,
        "quarantine_dir": quarantine if os.path.isdir(quarantine) else None,
        "quarantined_files": len(quarantined),
        "quarantined_bytes": sum(quarantined),
        "namespaces": {
            ns: {**spec_fields(read_spec(cdir, ns)), **usage.as_dict()}
            for ns, usage in per_ns.items()
        },
        "tenants": tenants_report(index, by_tenant),
        "pinned_chunks": pinned.chunks,
        "pinned_bytes": pinned.bytes,
        "pins": pins_report(index),
    }
    claims = claims_held(cdir, index)
    if claims is not None:
        report["claims"] = claims
    # the disk's read speeds and the first-read route they chose; None: the
    # constants' route (no calibration for this device)
    report["read_calibration"] = calibration.as_stats(cdir)
    report["admission"] = admission_report(index)
    # Deprecated aliases, kept for one release (scripts/demo_vllm.py and
    # operators' scripts read them): use used_bytes, chunks and blocks.
    report["total_bytes"] = total.bytes
    report["num_chunks"] = total.chunks
    report["num_blocks"] = total.blocks
    return report


#: what ``auto`` would write now, by the mode it chooses
_MODE_NAMES = {Mode.ALL: "write-all", Mode.SECOND_SIGHT: "second sight"}


def admission_report(index: Index) -> dict[str, Any]:
    """The directory's admission state (``Index.admission_report``) as
    ``npukv stats`` shows it: what ``auto`` would choose now from the
    shadows' scores (the index does not record the servers' ``admission``
    setting), the scores, the ghost's size, the write budget left (None
    when no budget was recorded), and the counters of every process: the
    directory's totals and per tenant (each with every counter, 0 included).
    """
    state: dict[str, Any] = dict(index.admission_report())
    scores = Scores(
        float(state["shadow_hits_all"]),
        float(state["shadow_hits_second_sight"]),
        float(state["shadow_asks"]),
        float(state.get("shadow_writes_all", 0.0)),
        float(state.get("shadow_writes_second_sight", 0.0)),
    )
    # without the budget: choose_mode's view of it needs the bucket's size,
    # which only the servers' config knows
    mode = choose_mode("auto", scores, 1.0, AdmissionTuning())
    tables: dict[str, int] = dict(state["tables"])
    budget = state["budget"]
    tenants = {
        name: {key: int(named.get(key, 0)) for key in ADMISSION_COUNTERS}
        for name, named in sorted(state["tenants"].items())
    }
    totals = {
        key: sum(named[key] for named in tenants.values()) for key in ADMISSION_COUNTERS
    }
    return {
        "auto_choice": _MODE_NAMES.get(mode, mode.name.lower()),
        "shadow_hits_all": scores.hits_all,
        "shadow_hits_second_sight": scores.hits_second_sight,
        "shadow_asks": scores.asks,
        "shadow_writes_all": scores.writes_all,
        "shadow_writes_second_sight": scores.writes_second_sight,
        "ghost_blocks": tables.get("ghost", 0),
        "tables": tables,
        "budget_left_bytes": None if budget is None else budget["tokens_bytes"],
        "budget_updated_ns": None if budget is None else budget["updated_ns"],
        **totals,
        "tenants": tenants,
    }


def _scan(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def claims_held(cdir: CacheDir, index: Index) -> int | None:
    """Save claims in the directory (None when it keeps none)."""
    held = getattr(index, "claims_held", None)
    if callable(held):
        return int(held())
    path = os.path.join(cdir.root, "claims")
    if not os.path.isdir(path):
        return None  # opening the table would create it: stats only reads
    from npukv_store.store.claims import ClaimTable

    table = ClaimTable(path, access=cdir.access)
    try:
        return table.held()
    finally:
        table.close()


def namespace_report(cdir: CacheDir, index: Index, namespace: str) -> dict[str, Any]:
    """The ``npukv inspect DIR NAMESPACE --json`` object: spec, layout, usage."""
    per_ns, _ = usage_by_namespace(cdir, index)
    spec = read_spec(cdir, namespace)
    report: dict[str, Any] = {"namespace": namespace, **spec_fields(spec)}
    if spec is not None:
        report.update(
            revision=spec.revision,
            pp_rank=spec.pp_rank,
            pp_size=spec.pp_size,
            rank_independent=spec.rank_independent,
            layout=layout(spec),
        )
    return {**report, **per_ns.get(namespace, Usage()).as_dict()}


def layout(spec: NamespaceSpec) -> dict[str, Any]:
    """Layers grouped by identical parts: most models have one group."""
    groups: dict[tuple[object, ...], dict[str, Any]] = {}
    for layer in spec.layers:
        shape = tuple((p.name, p.dtype, p.row_shape) for p in layer.parts)
        parts = [
            {"name": p.name, "dtype": p.dtype, "row_shape": list(p.row_shape),
             "row_bytes": p.row_bytes}
            for p in layer.parts
        ]  # fmt: skip
        group = groups.setdefault(
            shape, {"layer_count": 0, "row_bytes": layer.row_bytes, "parts": parts}
        )
        group["layer_count"] += 1
    return {
        "layers": len(spec.layers),
        "block_bytes": spec.block_bytes,
        "groups": list(groups.values()),
    }


def chunk_report(
    header: ChunkHeader, chunk_id: str | None, live_rows: int | None, keys: int
) -> dict[str, Any]:
    """The ``npukv inspect CHUNK_FILE --json`` object; ``live_rows`` is the
    index's (None when the index does not have the chunk)."""
    return {
        "path": os.path.abspath(header.path),
        "chunk_id": chunk_id,
        "file_size": header.file_size,
        "data_start": header.data_start,
        "namespace": header.namespace,
        "num_blocks": header.num_blocks,
        "live_rows": live_rows,
        "created_ns": int(header.metadata.get(META_CREATED_NS, "0") or 0),
        "creator": header.metadata.get(META_CREATOR),
        "checksums": list(header.checksums.shape),
        "keys": [k.hex() for k in header.keys[:keys]],
        "layers": {
            name: [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in entries]
            for name, entries in zip(header.layer_names, header.layers, strict=True)
        },
        "metadata": {k: v for k, v in header.metadata.items() if k != "npukv_keys"},
    }
