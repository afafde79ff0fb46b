"""DeepSeek-V3.2's lightning-indexer cache: stored with the MLA latent, loaded
with it or not at all (issue 28 part 2; docs/vllm.md §4).

The registrations are shaped as each stack shapes them (scaled down: a
latent of NOPE + ROPE, an indexer key of IDX):

- **vLLM 0.32** (`deepseek_v2.py:638-666`): the indexer key cache is a layer
  of its own, ``<layer>.self_attn.indexer.k_cache``, with an
  ``MLAAttentionSpec`` of ``head_size`` 132 (128 fp8 values and an fp32
  scale per token) in ``uint8``; the latent layers' MLAAttentionSpec pages
  differ, so both sit in one ``UniformTypeKVCacheSpecs`` group, one block
  table (`kv_cache_utils.py:2189`).
- **vllm-ascend 0.23.0.post1** (`model_runner_v1.py:4543-4682`): vLLM's
  indexer cache is skipped, and each MLA layer registers
  ``(nope, rope, indexer key[, indexer key scale])`` under an
  ``AscendMLAAttentionSpec`` with ``sparse_head_dim`` (LI C8: an int8 key and
  its fp16 scale).

A real worker saves blocks into a real store and another loads them into
other blocks: every byte of latent and indexer key comes back. A block whose
indexer row is damaged on disk is a miss as a whole: the load reports it
failed (vLLM recomputes it) and its latent is not counted as loaded.
"""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch

from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.worker.side import WorkerSide
from tests.support import faults
from tests.support.ascend import NOPE, ROPE, ascend_mla
from tests.support.chunks import chunk_files
from tests.support.connector import BLOCK, NUM_BLOCKS, engine_config, settings

IDX = 12  # the indexer key's bytes per token here (132 in DeepSeek-V3.2)
MLA_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
INDEXER_LAYERS = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]
KEYS = [bytes([150 + i]) * 16 for i in range(3)]
SOURCE, TARGET = [4, 11, 7], [20, 21, 22]


def vllm_spec(head_size: int, dtype: torch.dtype):
    """vLLM's MLAAttentionSpec of one latent (or indexer) layer."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=dtype
    )


def vllm_config_032():
    """One group of latent and indexer layers, as vLLM 0.32 groups them."""
    wrapper = type("UniformTypeKVCacheSpecs", (SimpleNamespace,), {})
    specs = {name: vllm_spec(NOPE + ROPE, torch.bfloat16) for name in MLA_LAYERS}
    specs |= {name: vllm_spec(IDX, torch.uint8) for name in INDEXER_LAYERS}
    names = [n for pair in zip(MLA_LAYERS, INDEXER_LAYERS, strict=True) for n in pair]
    group = SimpleNamespace(
        layer_names=names, kv_cache_spec=wrapper(kv_cache_specs=specs)
    )
    return engine_config(mla=True, groups=[group])


def caches_032(seed: int) -> dict[str, torch.Tensor]:
    """[num_blocks, 1, block_size, C] views: bf16 latent, uint8 indexer."""
    gen = torch.Generator().manual_seed(seed)
    caches = {
        name: torch.randn(NUM_BLOCKS, 1, BLOCK, NOPE + ROPE, generator=gen).to(
            torch.bfloat16
        )
        for name in MLA_LAYERS
    }
    for name in INDEXER_LAYERS:
        caches[name] = torch.randint(
            0, 256, (NUM_BLOCKS, 1, BLOCK, IDX), generator=gen, dtype=torch.uint8
        )
    return caches


def ascend_config(li_c8: bool):
    spec = ascend_mla(
        head_size=NOPE + ROPE + IDX,
        sparse_head_dim=(NOPE, ROPE, IDX),
        cache_sparse_li_c8=li_c8,
    )
    group = SimpleNamespace(layer_names=MLA_LAYERS, kv_cache_spec=spec)
    return engine_config(mla=True, groups=[group])


def caches_ascend(li_c8: bool):
    """Each layer (nope, rope, indexer key[, scale]), [NB, bs, 1, dim]."""

    def make(seed: int) -> dict[str, tuple[torch.Tensor, ...]]:
        gen = torch.Generator().manual_seed(seed)

        def part(dim: int, dtype: torch.dtype) -> torch.Tensor:
            if dtype == torch.int8:
                return torch.randint(
                    -128, 128, (NUM_BLOCKS, BLOCK, 1, dim), generator=gen,
                    dtype=torch.int8,
                )  # fmt: skip
            return torch.randn(NUM_BLOCKS, BLOCK, 1, dim, generator=gen).to(dtype)

        members = [(NOPE, torch.bfloat16), (ROPE, torch.bfloat16)]
        members += [(IDX, torch.int8), (1, torch.float16)] if li_c8 else [
            (IDX, torch.bfloat16)
        ]  # fmt: skip
        return {name: tuple(part(d, t) for d, t in members) for name in MLA_LAYERS}

    return make


def block_bytes(value, block: int) -> bytes:
    parts = value if isinstance(value, tuple) else (value,)
    return b"".join(
        p[block].contiguous().view(torch.uint8).numpy().tobytes() for p in parts
    )


def registered(tmp_path, config, caches) -> WorkerSide:
    worker = WorkerSide(*config, settings(tmp_path, layerwise="off"))
    worker.register(caches)
    assert worker.disabled_reason == "", worker.disabled_reason
    return worker


def save(tmp_path, config, source) -> None:
    saver = registered(tmp_path, config, source)
    saver.bind(NPUKVMetadata(saves=[BlockTransfer("r", SOURCE, [b"".join(KEYS)])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()


def load(tmp_path, config, target) -> set[int]:
    """Load KEYS into TARGET; the block ids reported failed."""
    loader = registered(tmp_path, config, target)
    loader.bind(NPUKVMetadata(loads=[BlockTransfer("r", TARGET, [b"".join(KEYS)])]))
    loader.start_load()
    loader.finish_step()
    failed = set(loader.take_load_errors())
    loader.close()
    return failed


CASES = {
    "vllm-0.32": (vllm_config_032, caches_032),
    "ascend": (lambda: ascend_config(False), caches_ascend(False)),
    "ascend-li-c8": (lambda: ascend_config(True), caches_ascend(True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_indexer_key_is_stored_and_loaded_with_the_latent(tmp_path, case):
    make_config, caches = CASES[case]
    config = make_config()
    scheduler = SchedulerSide(*config, settings(tmp_path))
    assert scheduler.disabled_reason == ""
    assert scheduler.engine is not None
    assert [g.kind for g in scheduler.engine.groups] == ["full"]
    source, target = caches(1), caches(2)
    save(tmp_path, config, source)
    assert load(tmp_path, config, target) == set()
    for name in source:
        for new, old in zip(TARGET, SOURCE, strict=True):
            assert block_bytes(target[name], new) == block_bytes(source[name], old), (
                name,
                new,
            )


def _indexer_row_offset(path: str, block_row: int) -> int:
    """Where, in a chunk file (safetensors), the first indexer layer's row
    ``block_row`` starts (vLLM 0.32's shape: the indexer is a layer of its
    own, one tensor of one row per block)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    (tensor,) = [k for k in header if k.startswith(INDEXER_LAYERS[0])]
    start, end = header[tensor]["data_offsets"]
    row = (end - start) // len(KEYS)
    return faults.data_start(path) + start + block_row * row


def test_a_block_whose_indexer_row_is_damaged_is_a_miss_as_a_whole(tmp_path):
    """The middle block's indexer row flipped on disk: that block fails as a
    whole (vLLM recomputes its latent too); the others load exact."""
    config = vllm_config_032()
    source, target = caches_032(1), caches_032(2)
    save(tmp_path, config, source)
    (path,) = chunk_files(str(tmp_path / "cache")).values()
    faults.flip_bit(path, _indexer_row_offset(path, 1) + 3, 0)
    failed = load(tmp_path, config, target)
    # the whole block fails, latent included (vLLM recomputes every layer
    # of it); blocks before it load exact
    assert TARGET[1] in failed
    assert TARGET[0] not in failed
    for name in source:
        assert block_bytes(target[name], TARGET[0]) == block_bytes(
            source[name], SOURCE[0]
        )
