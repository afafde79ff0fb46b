"""vllm-ascend's KV cache specs: which the connector serves and which it refuses.

vllm-ascend 0.23.0.post1 gives every MLA layer an ``AscendMLAAttentionSpec``
(a subclass of vLLM's MLAAttentionSpec, core/kv_cache_interface.py:27-121).
It is served as MLA full attention in its plain form (and in DeepSeek-V3.2's
sparse form: test_dsa_indexer.py); its compressed and scaled forms, a sparse
form with a replicated indexer, ``AscendSlidingWindowMLASpec`` and vLLM's
``HiddenStateCacheSpec`` are refused with one line naming the class and the
field. The stand-ins (tests/support/ascend.py) mirror vllm-ascend's class
names and fields.

With more than one KV cache group, vllm-ascend allocates attention layers in
kernel blocks of 128 tokens (model_runner_v1.py:4561-4569): each tensor's dim
0 is ``num_blocks * block_size / 128`` and a vLLM block is that many adjacent
rows. Such layers are stored and loaded bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    HiddenStateCacheSpec,
)

from npukv_store.connector.groups import ascend_mla_mismatch, classify
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.worker.ascend_rules import kernel_block_rows
from npukv_store.connector.worker.block_runs import build_runs
from npukv_store.connector.worker.pages import LayoutError, page_layout
from npukv_store.errors import UnsupportedSetup
from tests.support.ascend import (
    NOPE,
    ROPE,
    AscendSlidingWindowMLASpec,
    FakeNpuBackend,
    ascend_mla,
    make_worker,
)
from tests.support.connector import BLOCK, LAYERS, engine_config, settings


def mla_config(spec, layers=LAYERS):
    return engine_config(
        mla=True, groups=[SimpleNamespace(layer_names=layers, kv_cache_spec=spec)]
    )


def test_plain_ascend_mla_is_served_as_mla_full_attention(tmp_path):
    """DeepSeek V2/V3 on Ascend: one full group, one namespace for every rank,
    each layer's page the nope + rope latent of a block."""
    engine = engine_namespaces(*mla_config(ascend_mla()), settings(tmp_path))
    assert [g.kind for g in engine.groups] == ["full"]
    (rank_specs,) = engine.specs  # rank-independent: stored once
    (spec,) = rank_specs
    assert [layer.row_bytes for layer in spec.layers] == [BLOCK * (NOPE + ROPE) * 2] * 3
    assert "spec=AscendMLAAttentionSpec" in spec.extra
    side = SchedulerSide(*mla_config(ascend_mla()), settings(tmp_path))
    assert side.disabled_reason == ""


@pytest.mark.parametrize(
    ("fields_", "found"),
    [
        ({"compress_ratio": 4}, "compress_ratio=4, expected 1"),
        (
            {"sparse_head_dim": (NOPE, ROPE, 4), "sfa_dcp_replicated_indexer_size": 2},
            "sfa_dcp_replicated_indexer_size=2, expected 1",
        ),
        ({"scale_dim": 2}, "scale_dim=2, expected 0"),
    ],
)  # fmt: skip
def test_other_ascend_mla_forms_are_refused_naming_the_field(tmp_path, fields_, found):
    """DeepSeek V4's compressed layers, V3.2's sparse layers with an indexer
    replicated over DCP ranks, scaled C8 layers: one line with the class, a
    layer and the field. (V3.2's sparse form itself is served:
    tests/connector/test_dsa_indexer.py.)"""
    spec = ascend_mla(**fields_)
    with pytest.raises(UnsupportedSetup) as info:
        engine_namespaces(*mla_config(spec), settings(tmp_path))
    message = str(info.value)
    assert "KV cache group 0 is AscendMLAAttentionSpec" in message
    assert LAYERS[0] in message
    assert found in message
    assert "\n" not in message
    side = SchedulerSide(*mla_config(spec), settings(tmp_path))
    assert found in side.disabled_reason


def test_an_ascend_mla_page_other_than_nope_plus_rope_is_refused():
    """A page that is not block_size x heads x head_size x dtype size (a
    padded or packed page of some later vllm-ascend) is not plain MLA."""
    plain = ascend_mla()
    assert ascend_mla_mismatch(plain) == ""
    bigger = property(lambda self: plain.page_size_bytes + 64)
    # the same class name (what classify reads), with a larger page
    padded_class = type(
        type(plain).__name__, (type(plain),), {"page_size_bytes": bigger}
    )
    padded = padded_class(**{f.name: getattr(plain, f.name) for f in fields(plain)})
    reason = ascend_mla_mismatch(padded)
    assert reason.startswith(f"page_size_bytes={plain.page_size_bytes + 64}, expected")
    with pytest.raises(UnsupportedSetup, match="page_size_bytes="):
        classify("AscendMLAAttentionSpec", 0, LAYERS, [padded])


def test_every_layer_of_a_per_layer_group_is_checked():
    """UniformTypeKVCacheSpecs: one compressed layer among plain ones refuses
    the group; and the class alone, with no spec to read, is not served."""
    specs = [ascend_mla(), ascend_mla(compress_ratio=4), ascend_mla()]
    with pytest.raises(UnsupportedSetup, match="compress_ratio=4"):
        classify("AscendMLAAttentionSpec", 0, LAYERS, specs)
    assert classify("AscendMLAAttentionSpec", 0, LAYERS, specs[::2]) == "full"
    with pytest.raises(UnsupportedSetup, match="no spec given"):
        classify("AscendMLAAttentionSpec", 0, LAYERS)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            AscendSlidingWindowMLASpec(
                block_size=BLOCK, num_kv_heads=1, head_size=NOPE + ROPE,
                dtype=torch.bfloat16, sliding_window=4 * BLOCK,
            ),
            "DeepSeek V4's sliding-window MLA cache",
        ),
        (
            HiddenStateCacheSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=NOPE + ROPE,
                dtype=torch.bfloat16,
            ),
            "hidden states for speculative decoding",
        ),
    ],
)  # fmt: skip
def test_other_mla_like_specs_are_refused_with_their_reason(tmp_path, spec, reason):
    """Both are MLA-like subclasses (one of SlidingWindowMLASpec, one of
    MLAAttentionSpec): refused by class, not served as their parent."""
    name = type(spec).__name__
    groups = [
        SimpleNamespace(layer_names=LAYERS[:1], kv_cache_spec=spec),
        SimpleNamespace(layer_names=LAYERS[1:], kv_cache_spec=ascend_mla()),
    ]
    vllm_config, kv_cache_config = engine_config(mla=True, groups=groups)
    with pytest.raises(UnsupportedSetup) as info:
        engine_namespaces(vllm_config, kv_cache_config, settings(tmp_path))
    message = str(info.value)
    assert f"KV cache group 0 is {name} (1 layer(s), e.g. {LAYERS[0]})" in message
    assert reason in message
    assert "\n" not in message


# -- kernel blocks ---------------------------------------------------------------

KERNEL = 128  # vllm-ascend's kernel block size
BIG_BLOCK = 256  # a hybrid model's block size above it: 2 rows per block
ROWS = BIG_BLOCK // KERNEL
NB = 12
HEADS, HEAD_DIM = 2, 8


def kernel_split(seed: int, *dims: int, dtype=torch.float32) -> tuple:
    """Separately allocated members, each [NB * ROWS, 128, H, D], as
    model_runner_v1.py:4561-4627 shapes them with several groups."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(NB * ROWS, KERNEL, heads, dim, generator=gen).to(dtype)
        for heads, dim in dims
    )


def block_bytes(members: tuple, block: int) -> bytes:
    """What block ``block`` holds: its ROWS rows of every member, in order."""
    return b"".join(
        t[block * ROWS : (block + 1) * ROWS]
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for t in members
    )


def copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize(
    ("what", "dims", "dtype"),
    [
        ("gqa (k, v)", ((HEADS, HEAD_DIM), (HEADS, HEAD_DIM)), torch.float32),
        ("mla (nope, rope)", ((1, NOPE), (1, ROPE)), torch.bfloat16),
    ],
)
def test_kernel_block_rows_are_gathered_and_scattered_bit_exact(what, dims, dtype):
    """describe_layer's runs with 2 rows per block gather blocks 5, 0, 11
    into ring rows as exactly their rows' bytes, and scatter them back into
    other blocks of a zeroed cache bit for bit. One row per block gives a page
    of half the spec's, which is refused as before."""
    members = kernel_split(1, *dims, dtype=dtype)
    page = sum(BIG_BLOCK * h * d * members[0].element_size() for h, d in dims)
    caches = {"layer.0": members}
    with pytest.raises(LayoutError, match=f"block page of {page // 2} bytes"):
        page_layout("layer.0", caches, NB, page)
    layout = page_layout("layer.0", caches, NB, page, rows_per_block=ROWS)
    assert layout.page_bytes == page
    assert len(layout.segments) == len(members)  # dense rows: one run each
    ring = np.zeros(3 * page, np.uint8)
    src, dst, sizes = build_runs(
        [layout], [5, 0, 11], [0, 1, 2], ring.ctypes.data, page
    )
    copy(src, dst, sizes)
    for row, block in enumerate([5, 0, 11]):
        assert ring[row * page : (row + 1) * page].tobytes() == block_bytes(
            members, block
        )
    target = tuple(torch.zeros_like(t) for t in members)
    back = page_layout("layer.0", {"layer.0": target}, NB, page, rows_per_block=ROWS)
    src, dst, sizes = build_runs([back], [1, 2, 3], [0, 1, 2], ring.ctypes.data, page)
    copy(dst, src, sizes)  # scatter: rows to blocks
    for new, old in zip([1, 2, 3], [5, 0, 11], strict=True):
        assert block_bytes(target, new) == block_bytes(members, old)
    assert block_bytes(target, 0) == bytes(page)  # nothing else written


def test_kernel_rows_need_the_rows_and_only_an_npu_hybrid_uses_them():
    """A tensor with one row per block is not read as split (its rows would
    be too few), and the split is tried only where vllm-ascend makes it."""
    (k, v) = kernel_split(2, (HEADS, HEAD_DIM), (HEADS, HEAD_DIM))
    unsplit = (k[:NB], v[:NB])  # NB rows: a quarter of the page each
    with pytest.raises(LayoutError, match="rows per block"):
        page_layout("l", {"l": unsplit}, NB, 4 * k[0].nbytes, rows_per_block=ROWS)
    row = 2 * k[0].nbytes  # one row of k and of v
    message = f"block page of {row} bytes \\(nor with 2 rows per block\\), expected"
    with pytest.raises(LayoutError, match=message):  # neither matches: 1 row told
        page_layout("l", {"l": (k, v)}, NB, 3 * row, rows_per_block=ROWS)
    assert kernel_block_rows("npu", 2, BIG_BLOCK) == ROWS
    assert kernel_block_rows("npu", 2, 512) == 4
    assert kernel_block_rows("npu", 1, BIG_BLOCK) == 1  # one group: no split
    assert kernel_block_rows("npu", 2, KERNEL) == 1
    assert kernel_block_rows("cuda", 2, BIG_BLOCK) == 1


def test_a_hybrid_npu_worker_saves_and_loads_kernel_split_layers(tmp_path):
    """Two KV cache groups of block size 256 on an "npu": every layer a (k, v)
    tuple of [NB * 2, 128, H, D]. A worker saves blocks of both groups and
    another loads them into other blocks, bit for bit."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    common = dict(
        block_size=BIG_BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype=torch.float32,
    )
    groups = [
        SimpleNamespace(
            layer_names=layers[0::2],
            kv_cache_spec=SlidingWindowSpec(**common, sliding_window=4 * BIG_BLOCK),
        ),
        SimpleNamespace(
            layer_names=layers[1::2], kv_cache_spec=FullAttentionSpec(**common)
        ),
    ]
    config = engine_config(groups=groups)
    config[1].num_blocks = NB

    def worker(seed: int):
        caches = {
            name: kernel_split(seed + i, (HEADS, HEAD_DIM), (HEADS, HEAD_DIM))
            for i, name in enumerate(layers)
        }
        side = make_worker(tmp_path, config, caches, FakeNpuBackend(), layerwise="off")
        return side, caches

    keys = [[bytes([60 + g * 8 + i]) * 16 for i in range(3)] for g in range(2)]
    saver, source = worker(10)
    assert "2 rows per block" in saver.layers[0].layout.kind
    saves = [
        BlockTransfer("r", [2, 7, 5], [b"".join(keys[g])], group=g) for g in (0, 1)
    ]
    saver.bind(NPUKVMetadata(saves=saves))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()

    loader, target = worker(20)
    loads = [
        BlockTransfer("r", [9, 10, 11], [b"".join(keys[g])], group=g) for g in (0, 1)
    ]
    loader.bind(NPUKVMetadata(loads=loads))
    loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == set()
    for name in layers:
        for new, old in zip([9, 10, 11], [2, 7, 5], strict=True):
            assert block_bytes(target[name], new) == block_bytes(source[name], old)
    loader.close()
