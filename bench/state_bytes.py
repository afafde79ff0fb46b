"""Bytes of one linear-attention (GDN) state per KV block boundary, per vLLM 0.32.

Prints per (model, TP 1/8, ssm dtype), bf16 KV, bytes per TP rank: layers
(linear/full), one state per layer (conv + ssm), all linear layers' states at one
block boundary, vLLM's "align"-mode attention block size, the full-attention KV
of one block (all full layers) and state/KV. Align mode keeps one state per
linear layer per block boundary: this is what npukv_store stores per block
besides the KV. Computed by vLLM code (ModelConfig/VllmConfig from an offline
config.json, get_mamba_state_{shape,dtype}_from_config, *Spec.page_size_bytes,
Platform._align_hybrid_block_size with FlashAttention, the CUDA bf16 default).
"""

import argparse
import importlib.util
import inspect
import json
import sys
import tempfile
from pathlib import Path

# sys.path[0] is bench/ here, and bench/vllm.py would shadow the vllm package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import transformers as tf  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.model_executor.models import ModelRegistry  # noqa: E402
from vllm.model_executor.models.config import (  # noqa: E402
    Qwen3_5ForConditionalGenerationConfig as Qwen35Verify,
)
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as FA  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402

TMP = tempfile.TemporaryDirectory(prefix="state_bytes_")  # removed at exit
HAS_TV = importlib.util.find_spec("torchvision") is not None
# Only state/KV fields; the rest keep class defaults; full_attention_interval 4.
# Qwen3-Next-80B-A3B: Qwen3NextConfig defaults ("Qwen3-Next-80B-A3B style"):
#   48 layers, 2 KV heads x 256, GDN 16 K / 32 V heads x 128, conv 4; layers
#   and heads match THUDM/slime scripts/models/qwen3-next-80B-A3B.sh.
# Qwen3.5-397B-A17B: NVIDIA-NeMo/Megatron-Bridge models/qwen_vl/
#   qwen35_vl_provider.py Qwen35VLMoEModelProvider: 60 layers, 32 Q / 2 KV x 256,
#   GDN 16 K / 64 V x 128, conv 4 (slime qwen3.5-397B-A17B.sh: same attention).
# Qwen3.5-35B-A3B: Qwen3_5MoeTextConfig defaults (checkpoint Qwen/Qwen3.5-35B-A3B):
#   40 layers, 2 KV x 256, GDN 16 K / 32 V x 128; slime qwen3.5-35B-A3B.sh agrees.
# Qwen3.5-27B: Megatron-Bridge Qwen35VLModelProvider: 64 layers, 24 Q / 4 KV x
#   256, GDN 16 K / 48 V x 128; slime qwen3.5-27B.sh agrees on attention.
# mamba_ssm_dtype "float32" is in the published Qwen3.5 text_config (not in the
#   transformers class); vLLM's Qwen3_5*Config turns it into the ssm cache dtype.
MOE, DENSE = tf.Qwen3_5MoeTextConfig, tf.Qwen3_5TextConfig
MODELS = {
    "Qwen3-Next-80B-A3B": (tf.Qwen3NextConfig, "Qwen3NextForCausalLM", {}),
    "Qwen3.5-397B-A17B": (MOE, "Qwen3_5MoeForCausalLM", {
        "num_hidden_layers": 60, "num_attention_heads": 32,
        "linear_num_value_heads": 64}),
    "Qwen3.5-35B-A3B": (MOE, "Qwen3_5MoeForCausalLM", {}),
    "Qwen3.5-27B": (DENSE, "Qwen3_5ForCausalLM", {
        "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "linear_num_value_heads": 48}),
}  # fmt: skip


def check_proxy() -> None:
    # qwen3_5.py needs torchvision; Qwen3Next stands in if its methods read alike.
    spec = importlib.util.find_spec("vllm.model_executor.models.qwen3_5")
    src = Path(spec.origin).read_text()
    for meth in ("shape", "dtype"):
        fn = getattr(Qwen3NextForCausalLM, f"get_mamba_state_{meth}_from_config")
        body = inspect.getsource(fn).split(":\n", 1)[1]
        assert src.count(body) >= 2, meth  # CausalLM and VL classes


def row(name: str, tp: int, ssm: str) -> dict:
    cls, arch, kw = MODELS[name]
    qwen35 = cls is not tf.Qwen3NextConfig
    if qwen35:
        kw = dict(kw, mamba_ssm_dtype="float32")
        arch = arch if HAS_TV else "Qwen3NextForCausalLM"
    path = tempfile.mkdtemp(dir=TMP.name)  # fresh configs: a VllmConfig updates
    cls(architectures=[arch], dtype="bfloat16", **kw).save_pretrained(path)
    mc = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16")  # once
    cache = CacheConfig(enable_prefix_caching=True, mamba_ssm_cache_dtype=ssm)
    par = ParallelConfig(tensor_parallel_size=tp)
    vc = VllmConfig(model_config=mc, cache_config=cache, parallel_config=par)
    if qwen35 and ssm == "auto":
        Qwen35Verify.verify_and_update_config(vc)  # mamba_ssm_dtype -> cache
    cc = vc.cache_config
    assert cc.mamba_cache_mode == "align", cc.mamba_cache_mode
    # Undo the CPU platform's block size; start from what CUDA+FA picks.
    cc.block_size = FA.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
    Platform._align_hybrid_block_size(vc, FA)
    bs = cc.block_size
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    shapes = model_cls.get_mamba_state_shape_from_config(vc)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vc)
    conv, ssm_b = (
        MambaSpec(block_size=bs, shapes=(s,), dtypes=(d,)).page_size_bytes
        for s, d in zip(shapes, dtypes, strict=True)
    )
    state = MambaSpec(block_size=bs, shapes=shapes, dtypes=dtypes).page_size_bytes
    kv_heads, head = mc.get_num_kv_heads(par), mc.get_head_size()
    spec = dict(block_size=bs, num_kv_heads=kv_heads, head_size=head, dtype=mc.dtype)
    attn_b = FA.customize_spec(FullAttentionSpec(**spec)).page_size_bytes
    types = mc.hf_text_config.layer_types
    n_lin, n_full = types.count("linear_attention"), types.count("full_attention")
    return {
        "model": name, "tp": tp, "model_cls": model_cls.__name__,
        "linear_layers": n_lin, "full_layers": n_full,
        "shapes": [list(s) for s in shapes], "dtypes": [str(d) for d in dtypes],
        "conv_bytes": conv, "ssm_bytes": ssm_b, "state_bytes_per_layer": state,
        "state_bytes_per_boundary": state * n_lin, "block_size": bs,
        "mamba_page_size_padded": cc.mamba_page_size_padded,
        "kv_heads_per_rank": kv_heads, "kv_bytes_per_layer_block": attn_b,
        "kv_bytes_per_block": attn_b * n_full,
        "ratio_state_to_kv": state * n_lin / (attn_b * n_full),
    }  # fmt: skip


def main() -> None:
    out = _HERE.parent / "docs" / "benchmarks"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(out / "state_bytes.json"))
    args = ap.parse_args()
    if not HAS_TV:
        check_proxy()
    rows = []
    for name, (cls, _, _) in MODELS.items():
        ssms = ["auto"] if cls is tf.Qwen3NextConfig else ["auto", "bfloat16"]
        rows += [row(name, tp, s) for s in ssms for tp in (1, 8)]
    fmt = "{:<19}{:>3} {:>8} {:>5} {:>16} {:>11} {:>5} {:>10} {:>8}"
    print(fmt.format("model", "TP", "lin/full", "ssm", "conv+ssm B/layer",
                     "state B/bnd", "block", "KV B/blk", "state/KV"))  # fmt: skip
    for r in rows:
        print(fmt.format(
            r["model"], r["tp"], f"{r['linear_layers']}/{r['full_layers']}",
            r["dtypes"][1][6:].replace("bfloat", "bf").replace("float", "fp"),
            f"{r['conv_bytes']}+{r['ssm_bytes']}", r["state_bytes_per_boundary"],
            r["block_size"], r["kv_bytes_per_block"], f"{r['ratio_state_to_kv']:.2f}",
        ))  # fmt: skip
    print(
        "B per TP rank; FLASH_ATTN; Qwen3.5:", "real" if HAS_TV else "Qwen3Next class"
    )
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
