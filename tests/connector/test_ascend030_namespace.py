"""vllm-ascend 0.30.0rc2's KV formats in the namespace: a server whose KV
format changed (bf16 -> C8, C8 -> INT4 packing, a scale's dtype, the K/V
split, per-layer dtypes, C8-MXFP) misses instead of loading the old bytes,
and plain engines keep their keys (issue 38 part 2; docs/device.md §7.2).
The bytes themselves: test_ascend030_layouts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import FullAttentionSpec

from npukv_store.connector.namespace import engine_namespaces
from npukv_store.hashing import namespace_fingerprint
from tests.support import ascend as a23
from tests.support.ascend import ascend_mla
from tests.support.ascend030_specs import (
    BS,
    HEAD,
    LAYERS,
    LORA,
    MX_BS,
    MX_HEADS,
    ROPE,
    VLLM_HAS_030_SPECS,
    KVQuantMode,
    by_layer,
    config_of,
    fingerprint,
    gqa_spec,
    li_c8,
    mxfp_spec,
    packed_mla,
)
from tests.support.connector import settings as store_settings

pytestmark = pytest.mark.skipif(
    not VLLM_HAS_030_SPECS,
    reason="vLLM before 0.30 has none of the spec fields vllm-ascend 0.30 sets",
)


#: built when a test runs (vLLM 0.23 has not the fields to build them)
FORMATS = {
    "kv dtype (bf16 -> int8 C8)": lambda: (
        gqa_spec(),
        gqa_spec(dtype=torch.int8, head_size=2 * HEAD),
    ),
    "kv quant mode": lambda: (
        gqa_spec(dtype=torch.int8),
        gqa_spec(dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD),
    ),
    "C8 against INT4 packing": lambda: (
        packed_mla("c8", head_size=64),
        packed_mla("tq4", head_size=64),
    ),
    "scale dtype (fp16 -> bf16)": lambda: (
        li_c8(),
        li_c8(c8_k_scale_cache_dtype=torch.bfloat16),
    ),
    "C8 key dtype (int8 -> fp8)": lambda: (
        li_c8(),
        li_c8(c8_k_cache_dtype=torch.float8_e4m3fn),
    ),
    "C8-MXFP against plain FP8": lambda: (
        mxfp_spec(),
        FullAttentionSpec(
            block_size=MX_BS,
            num_kv_heads=MX_HEADS,
            head_size=66,
            dtype=torch.float8_e4m3fn,
        ),
    ),
    "K/V split": lambda: (gqa_spec(), gqa_spec(head_size=12, head_size_v=4)),
    "per-layer dtypes": lambda: (
        by_layer(gqa_spec(dtype=torch.int8, head_size=16), gqa_spec()),
        by_layer(gqa_spec(), gqa_spec(dtype=torch.int8, head_size=16)),
    ),
}


@pytest.mark.parametrize("what", sorted(FORMATS))
def test_a_changed_format_of_the_same_page_size_changes_the_namespace(what):
    """Each pair stores pages of the same size whose bytes mean different
    things: a server whose KV format changed must miss, not load old bytes."""
    before, after = FORMATS[what]()
    layers = LAYERS[:2] if what == "per-layer dtypes" else LAYERS
    engines = [
        engine_namespaces(*config_of((layers, s)), store_settings(Path("/nonexistent")))
        for s in (before, after)
    ]
    rows = [[lay.row_bytes for lay in e.specs[0][0].layers] for e in engines]
    assert rows[0] == rows[1]  # the same page sizes: only the format differs
    assert fingerprint((layers, before)) != fingerprint((layers, after))


def test_the_physical_layout_name_is_in_the_namespace():
    """vLLM's KV cache layout (the page's stride order on 0.32+) was already
    covered; it stays."""
    plain = config_of((LAYERS, gqa_spec()))
    other = config_of((LAYERS, gqa_spec()))
    other[1].kv_cache_layout = "LBNHC"
    prints = [
        namespace_fingerprint(
            engine_namespaces(*c, store_settings(Path("/nonexistent"))).specs[0][0]
        )
        for c in (plain, other)
    ]
    assert prints[0] != prints[1]


def test_plain_engines_keep_their_keys():
    """No new field appears for plain KV (and a 0.23-era plain MLA spec), so
    the fingerprints of existing caches are what they were."""
    import vllm
    from vllm.platforms import current_platform

    minor = ".".join(vllm.__version__.split(".")[:2])
    # "cpu" on vLLM's CPU build; "" on PyPI's CUDA wheel without a GPU
    platform = current_platform.device_type
    engine = engine_namespaces(
        *config_of((LAYERS, gqa_spec())), store_settings(Path("/nonexistent"))
    )
    assert engine.specs[0][0].extra == (
        f"platform={platform};layout=LBHNC;vllm={minor};user=;groups=1;group=0;"
        "kind=full;tail=0;spec=FullAttentionSpec"
    )
    mla = a23.AscendMLAAttentionSpec030(
        block_size=BS, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.bfloat16
    )
    extra = (
        engine_namespaces(
            *config_of((LAYERS, mla)), store_settings(Path("/nonexistent"))
        )
        .specs[0][0]
        .extra
    )
    assert extra.endswith("spec=AscendMLAAttentionSpec")


@settings(max_examples=60, deadline=None)
@given(
    forms=st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from([torch.float16, torch.bfloat16]),
            st.sampled_from([torch.int8, torch.float8_e4m3fn]),
            st.sampled_from(["c8", "tq4"]),
        ),
        min_size=2,
        max_size=2,
    )
)
def test_namespaces_differ_exactly_when_formats_differ(forms):
    """Random C8 indexers (on or off, their scale and key dtypes, all of one
    size) and packed latents (C8 or INT4, forced to one slot size): two
    engines share a namespace if and only if their formats are the same."""

    def key(c8, scale, key_dtype, packing):
        return (c8, scale, key_dtype) if c8 else (c8,), packing

    prints = []
    for c8, scale, key_dtype, packing in forms:
        indexer = (
            li_c8(c8_k_scale_cache_dtype=scale, c8_k_cache_dtype=key_dtype)
            if c8
            else ascend_mla(
                head_size=a23.NOPE + a23.ROPE + 12,
                sparse_head_dim=(a23.NOPE, a23.ROPE, 12),
            )
        )
        latent = packed_mla(packing, head_size=64)
        config = config_of((LAYERS[:1], indexer), (LAYERS[1:], latent))
        config[0].model_config.use_mla = True
        engine = engine_namespaces(*config, store_settings(Path("/nonexistent")))
        prints.append([namespace_fingerprint(spec) for spec in engine.specs[0]])
    same = [prints[0][g] == prints[1][g] for g in (0, 1)]
    assert same == [key(*forms[0])[g] == key(*forms[1])[g] for g in (0, 1)]
