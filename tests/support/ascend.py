"""Stand-ins for vllm-ascend and an Ascend NPU, for the connector's tests.

- ``AscendMLAAttentionSpec`` and ``AscendSlidingWindowMLASpec`` mirror
  vllm-ascend 0.23.0.post1's class names and fields; :func:`ascend_mla` is
  the spec it builds for a plain MLA layer;
- ``FakeNpuBackend`` is the CPU backend (copies are memcpys) with the kind
  "npu", events that only complete when synchronized, and a compute stream
  that records what it was made to wait on;
- :func:`make_worker`: a registered worker, on such a backend when given;
- for vllm-ascend 0.30 (tests/connector/test_ascend030_layouts.py):
  ``AscendMLAAttentionSpec030`` (0.30.0rc2's fields, under the class's own
  name), engines of given groups, and :func:`worker_round_trip`, a save and
  a load through real workers compared byte for byte.

Imports vLLM and torch: only the connector's tests use it (tests/connector).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

import npukv_store.device as device
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.device.cpu import CpuBackend
from npukv_store.hashing import namespace_fingerprint
from tests.support.connector import BLOCK, engine_config, settings

NOPE, ROPE = 16, 8  # kv_lora_rank, qk_rope_head_dim (512 and 64 in DeepSeek)
# vLLM 0.23's MLAAttentionSpec has compress_ratio; later ones do not
_PARENT_HAS_RATIO = "compress_ratio" in {f.name for f in fields(MLAAttentionSpec)}


@dataclass(frozen=True, kw_only=True)
class AscendMLAAttentionSpec(MLAAttentionSpec):
    """vllm-ascend 0.23.0.post1's fields and (non-sparse) page size."""

    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    sparse_head_dim: tuple[int, ...] | None = None
    cache_sparse_sfa_c8: bool = False
    cache_sparse_li_c8: bool = False
    c8_k_cache_dtype: torch.dtype = torch.int8
    c8_k_scale_cache_dtype: torch.dtype = torch.float16
    sfa_dcp_replicated_indexer_size: int = 1
    if not _PARENT_HAS_RATIO:
        compress_ratio: int = 1

    @property
    def page_size_bytes(self) -> int:
        # kv_cache_interface.py:66-121, branch by branch
        per_page = self.block_size * self.num_kv_heads
        replicas = self.sfa_dcp_replicated_indexer_size
        scale = self.c8_k_scale_cache_dtype.itemsize
        if self.cache_sparse_sfa_c8:  # (packed latent, indexer key[, scale])
            latent, _rope, index = self.sparse_head_dim or (0, 0, 0)
            key_dtype = self.c8_k_cache_dtype if self.cache_sparse_li_c8 else self.dtype
            return per_page * (
                latent * self.c8_k_cache_dtype.itemsize
                + index * replicas * key_dtype.itemsize
                + (replicas * scale if self.cache_sparse_li_c8 and index else 0)
            )
        if self.cache_sparse_li_c8:  # (nope, rope, int8 indexer key, its scale)
            nope, rope, index = self.sparse_head_dim or (0, 0, 0)
            return per_page * (
                (nope + rope) * self.dtype.itemsize
                + index * replicas * self.c8_k_cache_dtype.itemsize
                + replicas * scale
            )
        head = self.head_size
        if self.sparse_head_dim is not None and replicas > 1:
            nope, rope, index = self.sparse_head_dim
            head = nope + rope + index * replicas
        return per_page * (
            head * self.dtype.itemsize + self.scale_dim * self.scale_dtype.itemsize
        )


@dataclass(frozen=True, kw_only=True)
class AscendSlidingWindowMLASpec(SlidingWindowMLASpec):
    """kv_cache_interface.py:253 (DeepSeek V4)."""

    compress_ratio: int = 1


def ascend_mla(**kw) -> AscendMLAAttentionSpec:
    """The spec model_runner_v1.py:4993 builds for a plain MLA layer (and,
    with ``sparse_head_dim``, :4949-4985's for a sparse one)."""
    fields_ = {"head_size": NOPE + ROPE, "dtype": torch.bfloat16, **kw}
    return AscendMLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, **fields_)


def make_worker(tmp_path, config, caches, backend=None, **kw) -> WorkerSide:
    """A registered worker; on ``backend`` (a stand-in) when given."""
    original = device.get_backend
    if backend is not None:
        device.get_backend = lambda _device: backend
    try:
        worker = WorkerSide(*config, settings(tmp_path, **kw))
        worker.register(caches)
    finally:
        device.get_backend = original
    assert worker.disabled_reason == "", worker.disabled_reason
    return worker


class FakeEvent:
    """Complete only once synchronized: a copy on a device stream that no one
    fenced may still be running."""

    def __init__(self) -> None:
        self.recorded = False
        self.synchronized = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[FakeEvent] = []
        self.on_wait = None  # called with each event waited on

    def wait_event(self, event) -> None:
        self.waited.append(event)
        if self.on_wait is not None:
            self.on_wait(event)

    def wait_stream(self, other) -> None:
        pass

    def raw_handle(self) -> int:
        return 0


class FakeNpuBackend(CpuBackend):
    kind = "npu"  # type: ignore[assignment]
    host_view = None  # device memory: loads go through host slots

    def __init__(self) -> None:
        super().__init__()
        self.compute = FakeStream()
        self.events: list[FakeEvent] = []

    def current_stream(self):
        return self.compute

    def new_stream(self):
        return FakeStream()

    def new_event(self, timing: bool = False):
        event = FakeEvent()
        self.events.append(event)
        return event


# -- vllm-ascend 0.30: its MLA spec, engines, a worker round trip ------------------


def _ascend_mla_030() -> type:
    """vllm-ascend 0.30.0rc2's AscendMLAAttentionSpec (core/kv_cache_interface
    .py:92-179), under the class name the connector reads: the SFA indexer
    left it (AscendSFAIndexerCacheSpec), and a packed main cache (C8 or
    TurboQuant) is one int8 slot per token."""

    @dataclass(frozen=True, kw_only=True)
    class AscendMLAAttentionSpec(MLAAttentionSpec):
        scale_dim: int = 0
        scale_dtype: torch.dtype = torch.int8
        cache_sparse_sfa_c8: bool = False
        cache_sparse_sfa_turboquant: bool = False
        store_on_host: bool = False
        indexes_kv_by_block_stride: bool = False

        @property
        def real_page_size_bytes(self) -> int:
            elem, scale = self.dtype.itemsize, self.scale_dtype.itemsize
            per_token = self.head_size * elem + self.scale_dim * scale
            return self.block_size * self.num_kv_heads * per_token

        @property
        def page_size_bytes(self) -> int:
            padded = self.page_size_padded
            return self.real_page_size_bytes if padded is None else padded

    return AscendMLAAttentionSpec


AscendMLAAttentionSpec030 = _ascend_mla_030()


def config_of(*groups, num_blocks: int):
    """An engine of these (layer names, spec) groups and ``num_blocks``."""
    config = engine_config(
        groups=[SimpleNamespace(layer_names=n, kv_cache_spec=s) for n, s in groups]
    )
    config[1].num_blocks = num_blocks
    return config


def per_layer(specs: dict):
    """vLLM's UniformTypeKVCacheSpecs: one group, a spec per layer."""
    wrapper = type("UniformTypeKVCacheSpecs", (SimpleNamespace,), {})
    return wrapper(kv_cache_specs=specs)


def fingerprints(config) -> list[bytes]:
    """The namespace fingerprint of each group of ``config`` (rank 0)."""
    engine = engine_namespaces(*config, settings(Path("/nonexistent")))
    return [namespace_fingerprint(spec) for spec in engine.specs[0]]


def worker_round_trip(
    tmp_path, config, make, source, target, groups=(0,), checked=None
) -> None:
    """Save blocks ``source`` of ``make(1)``'s layers (name -> an object with
    ``value``, ``buffers``, ``block_bytes(b)``, ``zero_blocks(bs)``: see
    tests/support/ascend030.py) through a real worker on a fake NPU, load
    them into blocks ``target`` of ``make(2)``'s zeroed buffers: every byte
    equal, and no other byte written. ``checked``: the layers whose blocks
    move (default: all); the others are registered, and their bytes, in the
    buffers they may share, must stay zero."""
    keys = [
        b"".join(bytes([90 + 40 * g + i]) * 16 for i in range(len(source)))
        for g in range(2)
    ]
    regs = make(1)
    saver = make_worker(
        tmp_path, config, {n: r.value for n, r in regs.items()},
        FakeNpuBackend(), layerwise="off",
    )  # fmt: skip
    saver.bind(
        NPUKVMetadata(
            saves=[BlockTransfer("r", source, [keys[g]], group=g) for g in groups]
        )
    )
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    loaded = make(2)
    for reg in loaded.values():
        for buffer in reg.buffers:
            buffer.zero_()
    loader = make_worker(
        tmp_path, config, {n: r.value for n, r in loaded.items()},
        FakeNpuBackend(), layerwise="off",
    )  # fmt: skip
    loader.bind(
        NPUKVMetadata(
            loads=[BlockTransfer("r", target, [keys[g]], group=g) for g in groups]
        )
    )
    loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == set()
    loader.close()
    for name, reg in loaded.items():
        if checked is not None and name not in checked:
            continue
        for new, old in zip(target, source, strict=True):
            assert reg.block_bytes(new) == regs[name].block_bytes(old), (name, new)
        reg.zero_blocks(target)
    for name, reg in loaded.items():
        assert all(int(b.count_nonzero()) == 0 for b in reg.buffers), name
