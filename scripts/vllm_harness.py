"""Run real vLLM (CPU build) on a tiny random-weight Llama, with or without a
KV connector, and report tokens and timings as JSON.

Used by the end-to-end tests, the demo and bench_vllm.py. Every vLLM run is its
own process (as in production: a restart, a second instance), so callers run
this script as a subprocess:

    python scripts/vllm_harness.py build-model DIR [--layers 4 --hidden 128 ...]
    python scripts/vllm_harness.py run --model DIR --prompts FILE --out FILE \
        [--connector none|npukv|example] [--extra JSON] [--max-tokens N]

``run`` generates greedily for each prompt in order, one request at a time, and
writes ``{"results": [{"tokens", "num_cached_tokens", "seconds"}...], ...}``.
Nothing is downloaded: the model and its tokenizer are built locally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

#: Tokens of the unrelated prompt each run sends first (the connector stores
#: its full blocks too), and the default KV block size.
WARMUP_TOKENS = 100
BLOCK_SIZE = 32

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_model(
    path: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_positions: int,
    seed: int,
) -> None:
    """A Llama with random weights and a WordLevel tokenizer, saved to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: varied tokens
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    words = {f"w{i}": i for i in range(vocab)}
    words["<unk>"] = 0
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="w1", bos_token="w2"
    )
    fast.save_pretrained(path)


def transfer_config(connector: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    if connector == "npukv":
        return KVTransferConfig(
            kv_connector="NPUKVStoreConnector",
            kv_connector_module_path="npukv_store.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if connector == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    return None


def suppress_layer_hooks() -> None:
    """Make vLLM's attention skip the connector's layer hooks, as on a platform
    whose attention never calls them (in this process only: use it with
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.model_executor.layers.attention import kv_transfer_utils

    kv_transfer_utils.has_kv_transfer_group = lambda: False


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.no_layer_hooks:
        suppress_layer_hooks()
    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    extra = json.loads(args.extra) if args.extra else {}
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_model_len,
        kv_transfer_config=transfer_config(args.connector, extra),
        enable_prefix_caching=args.prefix_caching,
        seed=0,
    )
    startup_s = time.perf_counter() - started
    # The first requests of a process pay one-off costs (kernel selection for
    # new shapes, engines, threads); a short unrelated prompt takes them first.
    warmup = [TokensPrompt(prompt_token_ids=[5 + i for i in range(WARMUP_TOKENS)])]
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
    )
    results = []
    for tokens in [] if args.batch_only else prompts:
        ttft_s = None
        if args.ttft:  # time a prefill plus one token first
            begin = time.perf_counter()
            llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)],
                SamplingParams(temperature=0.0, max_tokens=1),
                use_tqdm=False,
            )
            ttft_s = time.perf_counter() - begin
        begin = time.perf_counter()
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False
        )
        results.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens or 0,
                "seconds": time.perf_counter() - begin,
                "ttft_s": ttft_s,
            }
        )
    report = {"startup_s": startup_s, "results": results}
    if args.concurrent_batch or args.batch_only:
        begin = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=t) for t in prompts], params, use_tqdm=False
        )
        report["batch"] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "seconds": time.perf_counter() - begin,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model")
    build.add_argument("path")
    build.add_argument("--layers", type=int, default=4)
    build.add_argument("--hidden", type=int, default=128)
    build.add_argument("--heads", type=int, default=2)
    build.add_argument("--kv-heads", type=int, default=2)
    build.add_argument("--vocab", type=int, default=2048)
    build.add_argument("--max-positions", type=int, default=4096)
    build.add_argument("--seed", type=int, default=0)
    go = sub.add_parser("run")
    go.add_argument("--model", required=True)
    go.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    go.add_argument("--out", required=True)
    go.add_argument("--connector", choices=("none", "npukv", "example"), default="none")
    go.add_argument("--extra", default="", help="kv_connector_extra_config as JSON")
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    go.add_argument("--dtype", default="float32", help="model and KV dtype")
    go.add_argument("--max-model-len", type=int, default=1024)
    go.add_argument(
        "--ttft", action="store_true", help="time max_tokens=1 before each prompt"
    )
    go.add_argument(
        "--batch-only", action="store_true", help="only run all prompts at once"
    )
    go.add_argument(
        "--no-layer-hooks", action="store_true", help="suppress the layer hooks"
    )
    go.add_argument(
        "--concurrent-batch", action="store_true", help="also run all prompts at once"
    )
    go.add_argument(
        "--prefix-caching",
        action="store_true",
        help="turn vLLM's own prefix cache on (off by default, so hits are ours)",
    )
    args = parser.parse_args(argv)
    if args.command == "build-model":
        build_model(
            args.path, layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab,
            max_positions=args.max_positions, seed=args.seed,
        )  # fmt: skip
        return 0
    report = run(args)
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())
