"""The KV cache specs of vllm-ascend 0.30.0rc2's layouts, for the tests of
tests/connector/test_ascend030_layouts.py (bytes) and
test_ascend030_namespace.py (what the namespace covers): one geometry, and
the spec builders both use.

vLLM 0.23 has none of the spec fields these set (page_size_padded,
state_content_bytes, kv_quant_mode): the builders are called only where the
tests run, never at import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1 import kv_cache_interface
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tests.support import ascend as a23
from tests.support import ascend030 as a30
from tests.support.ascend import ascend_mla

KVQuantMode = getattr(kv_cache_interface, "KVQuantMode", None)
#: vllm-ascend 0.30 runs on vLLM 0.30, whose specs have the fields its
#: layouts set (state_content_bytes: C8-MXFP's scales); vLLM 0.23 has not
VLLM_HAS_030_SPECS = KVQuantMode is not None and "state_content_bytes" in {
    f.name for f in dataclasses.fields(FullAttentionSpec)
}
NB = 12
BS, HEADS, HEAD = 16, 2, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
SOURCE, TARGET = [2, 9, 5], [10, 0, 7]


def gqa_spec(**kw) -> FullAttentionSpec:
    base = dict(block_size=BS, num_kv_heads=HEADS, head_size=HEAD)
    return FullAttentionSpec(**{"dtype": torch.bfloat16, **base, **kw})


def config_of(*groups):
    return a23.config_of(*groups, num_blocks=NB)


def fingerprint(*groups) -> list[bytes]:
    return a23.fingerprints(config_of(*groups))


MX_BS, MX_HEADS, MX_DIM = 64, 2, 64


def mxfp_spec(**kw) -> FullAttentionSpec:
    """mxfp_cache_spec (attention_c8_mxfp.py:181-192): FP8, and the scales
    budgeted through state_content_bytes."""
    content = 2 * MX_DIM + 2 * MX_DIM // a30.MXFP_GROUP
    return FullAttentionSpec(
        block_size=MX_BS, num_kv_heads=MX_HEADS, head_size=MX_DIM,
        dtype=torch.float8_e4m3fn, state_content_bytes=content, **kw,
    )  # fmt: skip


LORA, ROPE, TILE = 64, 16, 32  # kv_lora_rank, qk_rope_head_dim, SFA QSFA tile


def packed_mla(form: str, **kw) -> Any:
    """The 0.30 spec of an SFA main cache (model_runner_v1.py:6186-6235):
    one int8 slot per token, C8 (int8 nope, bf16 rope, fp32 tile scales) or
    TurboQuant (INT4 nope two per byte, bf16 rope, one fp16 scale)."""
    if form == "c8":
        head = a30.c8_packed_head_bytes(LORA, ROPE, TILE)
        kw = {"cache_sparse_sfa_c8": True, **kw}
    else:
        head = a30.tq4_slot_bytes(LORA, ROPE)
        kw = {"cache_sparse_sfa_turboquant": True, **kw}
    fields = {"head_size": head, **kw}  # a test may force one slot size
    return a23.AscendMLAAttentionSpec030(
        block_size=BS, num_kv_heads=1, dtype=torch.int8, **fields
    )


def li_c8(**kw: Any) -> Any:
    """vllm-ascend 0.23's served DSA form with a C8 indexer key and its scale
    (tests/support/ascend.py; test_dsa_indexer.py)."""
    return ascend_mla(
        head_size=a23.NOPE + a23.ROPE + 12, sparse_head_dim=(a23.NOPE, a23.ROPE, 12),
        cache_sparse_li_c8=True, **kw,
    )  # fmt: skip


def by_layer(*specs: Any) -> Any:
    return a23.per_layer(dict(zip(LAYERS[: len(specs)], specs, strict=True)))
