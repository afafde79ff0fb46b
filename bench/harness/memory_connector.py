"""MemoryConnector: a KV connector that keeps saved KV in this process's memory.

Why: a connector's hit costs vLLM something whatever the connector does (the
scheduler's external-hit path, block allocation, the connector hooks, the
step that carries the load). A hit from host memory, with no disk and almost
no work of its own, measures that fixed cost: its TTFT minus the TTFT of a hit
in vLLM's own prefix cache (which loads nothing) is ``vllm_fixed_hit_ms`` in
bench/vllm.py.

Use: ``kv_connector="MemoryConnector"``, ``kv_connector_module_path=
"bench.harness.memory_connector"`` (the repository root on sys.path;
``python -m bench.harness.vllm_run run --connector memory``), with
VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler's and the worker's halves
are two objects of one process and share ``_STORE``. Send a prompt twice: the
first computes and saves its full prompt blocks, the second claims them
(never the last token) and loads them synchronously in start_load_kv.

Kept simple, as vLLM's ExampleConnector: one KV cache group whose pages are
indexed by block id in dimension 0 (the CPU backend's layout), the blocks a
new request's first step fills are saved (a prompt must fit one step:
max_num_batched_tokens >= its length), no TP, no preemption handling.
``last_load_s`` keeps the seconds of the latest load's copies.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


@dataclass
class _Run:
    """The pages of consecutive blocks saved together: layer -> [n, *page]."""

    pages: dict[str, torch.Tensor]


@dataclass
class _Store:
    runs: list[_Run] = field(default_factory=list)
    where: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> run, row
    load_seconds: list[float] = field(default_factory=list)


_STORE = _Store()


def block_keys(tokens: list[int], block_size: int, count: int) -> list[bytes]:
    """Chained keys of the first ``count`` full blocks of ``tokens``."""
    keys, parent = [], b""
    for i in range(count):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + repr(block).encode()).digest()
        keys.append(parent)
    return keys


@dataclass
class _Transfer:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class MemoryMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


class MemoryConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._matched: dict[str, tuple[list[bytes], int]] = {}  # req -> keys, local
        self._loads: dict[str, _Transfer] = {}
        self._caches: dict[str, torch.Tensor] = {}

    # -- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        if not tokens:
            return 0, False
        bs = self._block_size
        keys = block_keys(tokens, bs, (len(tokens) - 1) // bs)  # never the last
        stored = 0
        while stored < len(keys) and keys[stored] in _STORE.where:
            stored += 1
        self._matched[request.request_id] = (keys[:stored], num_computed_tokens)
        return max(0, stored * bs - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        keys, local = self._matched.pop(request.request_id, ([], 0))
        if num_external_tokens <= 0:
            return
        start = local // self._block_size
        stop = start + num_external_tokens // self._block_size
        ids = blocks.get_block_ids()[0]
        self._loads[request.request_id] = _Transfer(keys[start:stop], ids[start:stop])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = MemoryMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in list(self._loads):
            if req_id in scheduled:
                meta.loads.append(self._loads.pop(req_id))
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            full = min(done, len(tokens)) // bs
            keys = block_keys(tokens, bs, full)
            rows = [i for i in range(full) if keys[i] not in _STORE.where]
            if rows:
                ids = new.block_ids[0]
                meta.saves.append(
                    _Transfer([keys[i] for i in rows], [ids[i] for i in rows])
                )
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None  # saves are copied in wait_for_save: blocks are free

    # -- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            if not isinstance(cache, torch.Tensor) or (
                self._num_blocks and cache.shape[0] != self._num_blocks
            ):
                raise ValueError(
                    f"MemoryConnector: layer {name}'s KV cache is not indexed by "
                    f"block in dimension 0 ({getattr(cache, 'shape', None)})"
                )
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MemoryMetadata)
        for load in meta.loads:
            began = time.perf_counter()
            self._load(load)
            _STORE.load_seconds.append(time.perf_counter() - began)

    def _load(self, load: _Transfer) -> None:
        places = [_STORE.where[key] for key in load.keys]
        run, first = places[0]
        one_run = all(p == (run, first + i) for i, p in enumerate(places))
        if one_run:  # the usual case: a prefix of one saved prompt
            index = torch.tensor(load.block_ids, dtype=torch.long)
            for name, cache in self._caches.items():
                source = _STORE.runs[run].pages[name][first : first + len(places)]
                cache.index_copy_(0, index, source)
            return
        for (run, row), block in zip(places, load.block_ids, strict=True):
            for name, cache in self._caches.items():
                cache[block].copy_(_STORE.runs[run].pages[name][row])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved in wait_for_save, once the forward has written every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MemoryMetadata)
        for save in meta.saves:
            index = torch.tensor(save.block_ids, dtype=torch.long)
            pages = {n: c.index_select(0, index) for n, c in self._caches.items()}
            _STORE.runs.append(_Run(pages))
            run = len(_STORE.runs) - 1
            for row, key in enumerate(save.keys):
                _STORE.where.setdefault(key, (run, row))


def last_load_s() -> float | None:
    """Seconds of the latest load's copies (None before any load)."""
    return _STORE.load_seconds[-1] if _STORE.load_seconds else None


def load_seconds() -> list[float]:
    """Seconds of every load's copies, in order."""
    return list(_STORE.load_seconds)
