"""A model's KV cache shape from its Hugging Face ``config.json``, for sizing.

Runs in: ``npukv plan`` and the benchmarks; pure (the caller reads the file).

    ModelShape.from_hf_config() - layers, MLA or GQA, heads, head dim, KV dtype
    ModelShape.rank_specs()     - the NamespaceSpecs a TP engine of it saves

What vLLM would give each worker, the way the connector names it
(connector/namespace.py): one layer part ``page`` per attention layer of
``page_size_bytes`` = block_size x bytes per token per rank:

    MLA (DeepSeek: kv_lora_rank set)  (kv_lora_rank + qk_rope_head_dim) x dtype,
                                      the same on every rank: ONE namespace
    GQA / MHA                         2 x max(1, kv_heads // TP) x head_dim x
                                      dtype, one namespace per rank (vLLM
                                      replicates a head when TP > kv_heads)

Sliding-window layers are counted as full layers (a plan's upper bound; the
connector saves all their blocks with ``sliding_save: all``). Linear attention
and Mamba layers are refused, as the connector refuses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from npukv_store.errors import ConfigError
from npukv_store.spec import LayerSpec, NamespaceSpec, PartSpec

#: Bytes per element of the KV dtypes a config names (``torch_dtype`` or
#: ``--kv-dtype``); fp8 KV caches are 1 byte.
KV_DTYPE_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "int8": 1,
}  # fmt: skip
#: Layer kinds of ``layer_types`` that have block-wise KV the store holds.
_ATTENTION_KINDS = {"full_attention", "sliding_attention", "attention"}


class ModelConfigError(ConfigError):
    """A config.json this plan cannot size (missing fields, unknown dtype)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a model's KV cache (see the module docstring)."""

    name: str
    num_layers: int
    mla: bool
    #: GQA: key/value heads of the whole model; MLA: 1 (the latent)
    kv_heads: int
    #: GQA: bytes-free dim of one head; MLA: kv_lora_rank + qk_rope_head_dim
    head_dim: int
    kv_dtype: str
    dtype_bytes: int

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], *, name: str = "model", kv_dtype: str = ""
    ) -> ModelShape:
        """The shape of a parsed ``config.json`` (a multimodal model's
        ``text_config`` when the top level has no layers).

        Args:
            kv_dtype: the KV cache dtype (vLLM's ``--kv-cache-dtype``); empty:
                the config's ``torch_dtype``.

        Raises:
            ModelConfigError: not a model config, a field missing or of the
                wrong type, an unknown dtype, or layers with no block-wise KV.
        """
        if not isinstance(config, Mapping):
            raise ModelConfigError(
                f"{name}: found a JSON {type(config).__name__}, expected a model's "
                "config.json object"
            )
        text = config.get("text_config")
        if "num_hidden_layers" not in config and isinstance(text, Mapping):
            config = {"torch_dtype": config.get("torch_dtype"), **text}
        layers = _positive(config, "num_hidden_layers", name)
        _refuse_linear_layers(config, name)
        dtype = (kv_dtype or str(config.get("torch_dtype") or "")).lower()
        dtype = dtype.removeprefix("torch.")
        if dtype not in KV_DTYPE_BYTES:
            raise ModelConfigError(
                f"{name}: KV dtype {dtype or 'missing'!r}, expected one of "
                f"{', '.join(sorted(KV_DTYPE_BYTES))} (torch_dtype, or --kv-dtype)"
            )
        if config.get("kv_lora_rank") is not None:
            latent = _positive(config, "kv_lora_rank", name)
            rope = _positive(config, "qk_rope_head_dim", name)
            return cls(
                name, layers, True, 1, latent + rope, dtype, KV_DTYPE_BYTES[dtype]
            )
        heads = _positive(config, "num_attention_heads", name)
        kv_heads = (
            _positive(config, "num_key_value_heads", name)
            if config.get("num_key_value_heads") is not None
            else heads
        )
        if config.get("head_dim") is not None:
            head_dim = _positive(config, "head_dim", name)
        else:
            head_dim = _positive(config, "hidden_size", name) // heads
        return cls(
            name, layers, False, kv_heads, head_dim, dtype, KV_DTYPE_BYTES[dtype]
        )

    def heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank holds: vLLM's max(1, kv_heads // tp); MLA 1."""
        return 1 if self.mla else max(1, self.kv_heads // tp)

    def token_bytes_per_rank(self, tp: int) -> int:
        """KV bytes of one token on one rank, all layers."""
        per_layer = self.head_dim * self.dtype_bytes * (1 if self.mla else 2)
        return self.num_layers * per_layer * self.heads_per_rank(tp)

    def rank_specs(self, tp: int, block_size: int) -> tuple[NamespaceSpec, ...]:
        """The namespaces a TP ``tp`` engine saves: one (MLA), else one per rank."""
        if tp < 1 or block_size < 1:
            raise ModelConfigError(
                f"tp {tp}, block size {block_size}: expected both >= 1"
            )
        page = self.token_bytes_per_rank(tp) // self.num_layers * block_size
        layers = tuple(
            LayerSpec(
                f"model.layers.{i}.self_attn.attn", (PartSpec("page", "U8", (page,)),)
            )
            for i in range(self.num_layers)
        )
        return tuple(
            NamespaceSpec(
                model=self.name,
                block_size=block_size,
                kv_dtype=self.kv_dtype,
                layers=layers,
                tp_rank=rank,
                tp_size=tp,
                rank_independent=self.mla,
            )  # fmt: skip
            for rank in range(1 if self.mla else tp)
        )


def _positive(config: Mapping[str, Any], key: str, name: str) -> int:
    value = config.get(key)
    if value is None:
        raise ModelConfigError(f"{name}: {key} missing, expected a positive integer")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(
            f"{name}: {key} is {value!r}, expected a positive integer"
        )
    return value


def _refuse_linear_layers(config: Mapping[str, Any], name: str) -> None:
    kinds = config.get("layer_types")
    if not isinstance(kinds, list):
        return
    other = sorted({str(k) for k in kinds} - _ATTENTION_KINDS)
    if other:
        raise ModelConfigError(
            f"{name}: layer_types include {', '.join(other)}, expected attention "
            "layers only (the connector does not serve linear attention or Mamba)"
        )
