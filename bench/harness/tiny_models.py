"""Tiny random-weight Hugging Face checkpoints of several model families, each
runnable by vLLM's CPU build, for testing KV connectors against the different
KV cache layouts (full attention, MoE, MLA, sliding window, linear attention).

    python -m bench.harness.tiny_models FAMILY PATH  # builds it, prints its facts

``PATH/model`` gets the checkpoint and ``PATH/tokenizer`` a WordLevel tokenizer
(ids 1/2/3 are bos/eos/pad). Run vLLM with ``LLM(model=..., tokenizer=...,
dtype=facts["dtype"], block_size=facts["block_size"], enforce_eager=True)``
(and ``attention_backend=facts["attention_backend"]`` where it is not None).
Nothing is downloaded.

Pitfalls (vLLM 0.32 CPU, transformers 5):

- transformers 5 picks Qwen2's own tokenizer class (which cannot read this
  vocabulary) for a tokenizer next to a qwen2 config.json, so every tokenizer
  lives in its own folder, passed to vLLM as ``tokenizer=``. That folder holds a
  one-line llama config.json: without any, vLLM retries parsing it (2 s per
  start, plus two ERROR lines).
- Gemma with tied embeddings and small random weights just repeats its input:
  its lm_head is untied (vLLM's Gemma3ForCausalLM loads one). Qwen3-MoE at
  std 0.06 repeats one token: it gets 0.08.
- CPU attention needs block sizes that are multiples of 32. MLA needs
  kv_lora_rank + qk_rope_head_dim == 576 and has two CPU backends: the
  reference CPU_MLA (any dtype, forces block size 16, turns prefix caching
  off) and, where the CPU has AMX (``amx_tile``), AMX_MLA, which vLLM picks
  there by default (bfloat16 only: float32 weights fail to load; block sizes
  of 32n; prefix caching stays on). DeepSeek-V2's facts name CPU_MLA
  (``attention_backend``, run as ``LLM(attention_backend=...)``), so it runs
  alike on every CPU; docs/vllm.md has the details.
- vLLM refuses Qwen2 with a sliding window on only some layers: none is used.
- CPU GDN (Qwen3-Next linear attention) runs only in bfloat16, with key and
  value head dims of 128. vLLM raises the block size until an attention page
  holds a linear-attention state; the sizes here keep it at 32. Qwen3-Next
  needs the hybrid KV cache manager, so a connector without SupportsHMA fails.
- Mamba2 hybrids (Nemotron-H here; Granite 4, Falcon-H1 and Zamba2 alike)
  run on vLLM 0.32's CPU build with prefix caching on (align mode) only in
  prefill chunks no longer than the model's chunk_size (128): its CPU scan
  returns one state per sequence where align mode asks one per chunk
  (IndexError in mamba_mixer2.py). Run them with max_num_batched_tokens 64.
- DeepSeek-V4 (transformers 5.19's class) runs in vLLM 0.32's CPU build only
  where the CPU has AMX: elsewhere its start-up fails in cpu_sparse.py
  (``torch.ops._C.convert_weight_packed`` is missing from the AVX2 kernels).
  Its config.json and tensor names are rewritten to the real checkpoint's.
- A script that starts vLLM needs ``if __name__ == "__main__":`` (it spawns
  processes). Run with HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  VLLM_CPU_KVCACHE_SPACE=1 (and VLLM_ENABLE_V1_MULTIPROCESSING=0 to reach the
  engine from the calling process).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

FAMILIES = (
    "llama", "qwen2", "qwen3_moe", "gemma3", "deepseek_v2", "qwen3_next", "nemotron_h",
    "deepseek_v4",
)  # fmt: skip

VOCAB = 3000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
INIT_STD = 0.06  # large enough for greedy output to depend on the context

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
}
_DENSE: dict[str, Any] = {"num_hidden_layers": 3, "num_key_value_heads": 2}

#: Per family: the transformers model type, its config (on top of _COMMON) and
#: the facts build() reports besides the paths.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "config": _DENSE},
    "qwen2": {"model_type": "qwen2", "config": {**_DENSE, "use_sliding_window": False}},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "config": {
            **_DENSE,
            "head_dim": 64,
            "moe_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
        },
        "init_std": 0.08,  # at 0.06 its greedy output repeats one token
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "config": {
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        "hybrid": "sliding",
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "config": {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "kv_lora_rank": 512,  # + qk_rope_head_dim must be 576 for CPU MLA
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "moe_intermediate_size": 128,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "topk_method": "greedy",
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
        "mla": True,
        # vLLM's reference CPU MLA backend, on every CPU: on one with AMX vLLM
        # would pick AMX_MLA (bf16 only, blocks of 32n, prefix caching on)
        "attention_backend": "CPU_MLA",
        "block_size": 16,  # CPU MLA forces it
        "prefix_caching": False,  # CPU MLA turns it off
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "config": {
            "num_hidden_layers": 4,  # 3 linear-attention layers, then 1 full
            "full_attention_interval": 4,
            "num_key_value_heads": 2,
            # A small linear-attention state (34 KiB) and a large attention page
            # (64 KiB at 32 tokens): vLLM raises the block size until a page
            # holds a state (4 value heads and head_dim 64 would give 288).
            "head_dim": 256,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "linear_key_head_dim": 128,  # the CPU GDN kernels' size
            "linear_value_head_dim": 128,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
        },
        "hybrid": "linear",
        "dtype": "bfloat16",  # CPU GDN attention requires BF16
    },
    # Mamba2 + attention (Nemotron-H): 2 Mamba2 layers, 1 attention layer,
    # 3 MLPs; vLLM raises the block size to 64 so a page holds a state
    "nemotron_h": {
        "model_type": "nemotron_h",
        "config": {
            "layers_block_type": [
                "linear_attention",
                "mlp",
                "full_attention",
                "mlp",
                "linear_attention",
                "mlp",
            ],
            "num_key_value_heads": 2,
            "head_dim": 64,
            "layer_norm_epsilon": 1e-5,
            "mamba_num_heads": 8,
            "mamba_head_dim": 64,
            "ssm_state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 128,
            "mlp_hidden_act": "relu2",
            "use_mamba_kernels": False,
        },  # fmt: skip
        "hybrid": "mamba2",
        "block_size": 64,
        "init_std": 0.12,  # at 0.06 its output hardly depends on the context
    },
    # DeepSeek-V4 (transformers 5.19's DeepseekV4ForCausalLM, saved in the
    # original checkpoint's names that vLLM's loader reads): a sliding-window
    # layer, a compressed one with the indexer (C4A) and a heavily compressed
    # one (C128A). The attention and indexer sizes are the real model's (the
    # CPU kernels are written for them); the rest is small. vLLM 0.32 runs it
    # on CPU only with AMX (its sparse-MLA and indexer kernels), with blocks of
    # 256 and prefix caching on; elsewhere it stops at start-up.
    "deepseek_v4": {
        "model_type": "deepseek_v4",
        "config": {
            "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 128],  # legacy form: layer_types
            "num_hash_layers": 0,  # every layer a top-k routed MoE
            "head_dim": 512,  # 448 nope + 64 rope, one KV head
            "qk_rope_head_dim": 64,
            "q_lora_rank": 128,
            "o_groups": 2,
            "o_lora_rank": 128,
            "sliding_window": 128,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 512,
            "hc_mult": 2,
            "hc_sinkhorn_iters": 3,
            # moe_intermediate_size: _COMMON's intermediate_size (512), which
            # transformers' DeepseekV4Config maps onto it
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "num_nextn_predict_layers": 0,
        },
        # config.json as the real checkpoint's: vLLM reads the legacy
        # per-layer fields (transformers folds them into layer_types and
        # mlp_layer_types, which vLLM's config class refuses; transformers
        # folds them back in when it reads the file)
        "vllm_config": {
            "compress_ratios": [0, 4, 128],
            "num_hash_layers": 0,
            "topk_method": "noaux_tc",  # vLLM loads the gate's bias then
            "layer_types": None,
            "mlp_layer_types": None,
        },
        # tensor names as vLLM's loader reads them (the real checkpoint's):
        # transformers saves most in them, these not; it reads both
        "vllm_names": (
            (r"^model\.", ""),
            (r"^embed_tokens\.", "embed."),
            (r"^hc_head\.hc_", "hc_head_"),
            (r"\.attn\.norm\.", ".attn.kv_norm."),
        ),
        "mla": True,
        "hybrid": "deepseek_v4",
        "block_size": 256,  # vLLM's CPU DeepSeek-V4 backends force it
        "dtype": "bfloat16",
    },
}


def build_tokenizer(path: str, vocab: int = VOCAB) -> None:
    """A WordLevel tokenizer over ``w{i}`` words, saved to ``path``, a folder of
    its own (so transformers cannot pick a family's own tokenizer class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)}
    words.update({token: i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    unk, bos, eos, pad = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
    )
    fast.save_pretrained(path)
    # vLLM parses the tokenizer folder's config (retrying, 2 s); llama keeps the
    # generic class that tokenizer_config.json names.
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)


def init_weights(model: Any, std: float = INIT_STD) -> None:
    """Draw every matrix (2 or more dims) from N(0, std). Vectors (norms, biases,
    Qwen3-Next's A_log and dt_bias) keep the family's own init, which the
    architecture relies on."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)


def _update_config(model_path: str, fields: dict[str, Any]) -> None:
    """Set ``fields`` in the saved config.json (None: remove the field)."""
    config_path = os.path.join(model_path, "config.json")
    with open(config_path) as f:
        saved = json.load(f)
    for key, value in fields.items():
        if value is None:
            saved.pop(key, None)
        else:
            saved[key] = value
    with open(config_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)


def _rename_tensors(model_path: str, renames: tuple[tuple[str, str], ...]) -> None:
    """Rename the saved tensors: each (pattern, replacement) in turn."""
    import re

    from safetensors.torch import load_file, save_file

    path = os.path.join(model_path, "model.safetensors")
    tensors = load_file(path)
    for pattern, replacement in renames:
        tensors = {re.sub(pattern, replacement, k): v for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def build(family: str, path: str, *, seed: int = 0) -> dict[str, Any]:
    """Write the ``family`` checkpoint to ``path/model`` and its tokenizer to
    ``path/tokenizer``; return the facts needed to run it in vLLM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}, expected one of {FAMILIES}")
    spec = _FAMILIES[family]
    dtype = spec.get("dtype", "float32")
    model_path = os.path.join(path, "model")
    tokenizer_path = os.path.join(path, "tokenizer")
    torch.manual_seed(seed)
    config = AutoConfig.for_model(spec["model_type"], **_COMMON, **spec["config"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Drawn in float32, then cast: the same draws whatever the dtype.
    init_weights(model, spec.get("init_std", INIT_STD))
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(model_path, safe_serialization=True)
    if spec.get("vllm_config"):
        _update_config(model_path, spec["vllm_config"])
    if spec.get("vllm_names"):
        _rename_tensors(model_path, spec["vllm_names"])
    build_tokenizer(tokenizer_path)
    return {
        "family": family,
        "model": model_path,
        "tokenizer": tokenizer_path,
        "model_type": spec["model_type"],
        "architecture": type(model).__name__,
        "block_size": spec.get("block_size", 32),  # CPU attention: multiples of 32
        "dtype": dtype,
        "layers": config.num_hidden_layers,
        "mla": spec.get("mla", False),
        "hybrid": spec.get("hybrid"),
        "attention_backend": spec.get("attention_backend"),  # None: vLLM's choice
        "prefix_caching": spec.get("prefix_caching", True),  # after vLLM's overrides
        "vocab_size": VOCAB,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("path", help="output folder (gets model/ and tokenizer/)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.family, args.path, seed=args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
