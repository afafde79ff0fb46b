"""Run real vLLM (CPU build) on a tiny random-weight Llama, with or without a
KV connector, and report tokens and timings as JSON.

Used by the end-to-end tests (bench/harness/runs.py), the demo and the vLLM
benchmarks. Every vLLM run is its own process (as in production: a restart, a
second instance), so callers run this module as a subprocess, the repository
root on PYTHONPATH (bench.harness.processes.child_env):

    python -m bench.harness.vllm_run build-model DIR [--layers 4 --hidden 128 ...]
    python -m bench.harness.vllm_run build-model DIR --family gemma3  # tiny_models
    python -m bench.harness.vllm_run run --model DIR --prompts FILE --out FILE \
        [--connector none|npukv|example] [--extra JSON] [--max-tokens N]

``run`` generates greedily for each prompt in order, one request at a time, and
writes ``{"results": [{"tokens", "num_cached_tokens", "external_tokens",
"seconds", "cpu_wait_ms", "psi_cpu_ms"}...], ...}`` (the last two: how long
the calling thread, and some task of the machine, waited for a CPU during the
call; see cpu_waits). ``external_tokens`` (the tokens our connector claimed
for the prompt) needs VLLM_ENABLE_V1_MULTIPROCESSING=0: it is read from the
scheduler-side connector in this process; None otherwise. vLLM's prefix cache
is on, as in production (``--no-prefix-caching`` turns it off).

``--connector memory`` is bench/harness/memory_connector.py (in-process only:
a prompt's KV kept in host memory, the second request of it a hit). For
bench/cold_hit.py: ``--trace FILE`` times vLLM's steps and the connectors'
hooks (bench/harness/trace.py, installed before vLLM starts) and
``--pause-after-warmup DIR`` waits for a profiler around the timed prompts
(``--pause-before I`` also before prompt I: a test acts between prompts).
``--shutdown`` shuts the engine down at the end, so the connector's close()
runs, and logs, before the process exits.

Test-only hooks, in-process mode too: ``--record-kv FILE`` writes a digest of
every KV block page the connector saves (by key and layer, taken when the
step's saves are copied out) and of every page it loads (taken right after the
load, before attention reads it: after start_load_kv in bulk mode, after each
wait_for_layer_load layer by layer). Nothing is downloaded: the model and its
tokenizer are built locally.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.harness.processes import child_env, python_module

#: Tokens of the unrelated prompt each run sends first (the connector stores
#: its full blocks too), and the default KV block size.
WARMUP_TOKENS = 100
BLOCK_SIZE = 32
FACTS_FILE = "npukv_model.json"  # what build_family knows about the model
MODULE = "bench.harness.vllm_run"  # run as python -m MODULE

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


def ensure_model(path: str | os.PathLike[str], shape: list[str]) -> None:
    """``build-model path *shape`` in a subprocess (the caller need not import
    torch and transformers), unless ``path`` holds a model already: the
    benchmarks' model, built once per work directory."""
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run(
            python_module(MODULE, "build-model", str(path), *shape),
            check=True, capture_output=True, env=child_env(),
        )  # fmt: skip


def build_family(path: str, family: str, seed: int) -> None:
    """A tiny model of ``family`` (bench/harness/tiny_models.py) in ``path``,
    with the facts a run needs (tokenizer, dtype, block size) in FACTS_FILE."""
    from bench.harness import tiny_models

    facts = tiny_models.build(family, os.path.abspath(path), seed=seed)
    with open(os.path.join(path, FACTS_FILE), "w") as f:
        json.dump(facts, f)


def model_facts(model: str) -> dict[str, Any]:
    """What build_family recorded for ``model`` ({} for build_model's Llama)."""
    try:
        with open(os.path.join(model, FACTS_FILE)) as f:
            facts: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return {}
    return facts


class KVRecorder:
    """Digests of the KV pages the connector saves and loads, by key and layer
    (``--record-kv``): a store run and a load run of the same prompts must
    agree byte for byte. Wraps WorkerSide methods in this process."""

    def __init__(self) -> None:
        self.saved: dict[str, dict[str, str]] = {}
        self.loaded: dict[str, dict[str, str]] = {}

    def install(self) -> None:
        from npukv_store.connector.worker.side import WorkerSide

        recorder = self
        register, finish = WorkerSide.register, WorkerSide.finish_step
        start, wait = WorkerSide.start_load, WorkerSide.wait_layer

        def register_(worker: Any, kv_caches: dict[str, Any]) -> None:
            worker.recorded_caches = kv_caches
            register(worker, kv_caches)

        def finish_(worker: Any) -> None:  # saves are copied out here at the latest
            recorder.note(worker, worker._meta.saves, recorder.saved, None)
            finish(worker)

        def start_(worker: Any) -> None:
            start(worker)
            if not worker.layerwise:  # bulk: every layer is in place now
                recorder.note(worker, worker._meta.loads, recorder.loaded, None)

        def wait_(worker: Any, layer_name: str) -> None:
            wait(worker, layer_name)
            if worker.layerwise and worker._meta.loads:
                recorder.note(worker, worker._meta.loads, recorder.loaded, layer_name)

        WorkerSide.register = register_  # type: ignore[method-assign]
        WorkerSide.finish_step = finish_  # type: ignore[method-assign]
        WorkerSide.start_load = start_  # type: ignore[method-assign]
        WorkerSide.wait_layer = wait_  # type: ignore[method-assign]

    @staticmethod
    def note(
        worker: Any, transfers: list[Any], into: dict[str, dict[str, str]],
        only: str | None,
    ) -> None:  # fmt: skip
        import hashlib

        caches = getattr(worker, "recorded_caches", None)
        if caches is None or worker.engine is None:
            return
        for transfer in transfers:
            names = worker.engine.groups[transfer.group].layer_names
            keys = transfer.keys(worker.rank)
            for name in names:
                if only is not None and name != only:
                    continue
                pages = caches[name]
                for key, block in zip(keys, transfer.block_ids, strict=True):
                    page = pages[block].contiguous().view(-1).view(dtype=_u8())
                    digest = hashlib.sha256(page.numpy().tobytes()).hexdigest()
                    into.setdefault(key.hex(), {})[name] = digest

    def report(self) -> dict[str, Any]:
        return {"saved": self.saved, "loaded": self.loaded}


def _u8() -> Any:
    import torch

    return torch.uint8


def count_external_tokens() -> list[int]:
    """Tokens the connector claims per request, summed into the returned
    list's last entry (the caller appends 0 before each prompt)."""
    from npukv_store.connector.connector import NPUKVStoreConnector

    counts = [0]
    update = NPUKVStoreConnector.update_state_after_alloc

    def update_(self: Any, request: Any, blocks: Any, num_external: int) -> None:
        counts[-1] += num_external
        update(self, request, blocks, num_external)

    NPUKVStoreConnector.update_state_after_alloc = update_  # type: ignore[method-assign]
    return counts


def transfer_config(connector: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    if connector in ("npukv", "npukv-startup-fault"):
        # npukv-startup-fault: tests/support/startup_fault.py, the connector
        # with a fault injected into both roles' start-up
        module = "npukv_store.connector"
        if connector == "npukv-startup-fault":
            module = "tests.support.startup_fault"
        return KVTransferConfig(
            kv_connector="NPUKVStoreConnector",
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if connector == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if connector == "memory":  # in-process only: the two halves share its store
        return KVTransferConfig(
            kv_connector="MemoryConnector",
            kv_connector_module_path="bench.harness.memory_connector",
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


def pretend_accelerator() -> None:
    """Make the CPU backend report kind "npu", so that ``layerwise: auto``
    takes its accelerator branch (turns layerwise on once it has seen every
    hook) while the copies still run on the CPU (in this process only)."""
    from npukv_store.device.cpu import CpuBackend

    CpuBackend.kind = "npu"  # type: ignore[assignment]


def cpu_waits() -> dict[str, float]:
    """Milliseconds this thread has been runnable without a CPU
    (``cpu_wait_ms``, /proc/thread-self/schedstat) and some task of the
    machine has (``psi_cpu_ms``, /proc/pressure/cpu): their growth over a
    timed call says how much of it other work took (2 cores, shared)."""
    found = {"cpu_wait_ms": 0.0, "psi_cpu_ms": 0.0}
    try:
        with open("/proc/thread-self/schedstat") as f:
            found["cpu_wait_ms"] = int(f.read().split()[1]) / 1e6
        with open("/proc/pressure/cpu") as f:
            found["psi_cpu_ms"] = int(f.readline().split()[-1].split("=")[1]) / 1e3
    except (OSError, IndexError, ValueError):
        pass
    return found


def _wait_for_gate(gate: str, ready: str, go: str) -> None:
    """``--pause-after-warmup``: say ``ready`` (a file in ``gate``), then wait
    until the caller creates ``go`` (it attaches a profiler meanwhile)."""
    open(os.path.join(gate, ready), "w").close()
    while not os.path.exists(os.path.join(gate, go)):
        time.sleep(0.01)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tracer = None
    if args.trace:  # bench/cold_hit.py: wrap before vLLM starts
        from bench.harness import trace

        tracer = trace.install()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.no_layer_hooks:
        suppress_layer_hooks()
    if args.pretend_accelerator:
        pretend_accelerator()
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    external = count_external_tokens() if in_process else None
    recorder = KVRecorder() if args.record_kv else None
    if recorder is not None:
        recorder.install()
    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    extra = json.loads(args.extra) if args.extra else {}
    facts = model_facts(args.model)
    started = time.perf_counter()
    options: dict[str, Any] = {}
    if args.hma is not None:  # vLLM decides by default (on with our connector)
        options["disable_hybrid_kv_cache_manager"] = args.hma == "off"
    if args.retention_interval:  # "dense": every block boundary
        dense = args.retention_interval == "dense"
        options["prefix_cache_retention_interval"] = (
            None if dense else int(args.retention_interval)
        )
    if args.kv_events_endpoint:
        from vllm.config import KVEventsConfig

        options["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=args.kv_events_endpoint, topic="kv",
        )  # fmt: skip
    backend = args.attention_backend or facts.get("attention_backend")
    if backend:  # e.g. CPU_MLA, the reference CPU MLA backend, on any CPU
        options["attention_backend"] = backend
    llm = LLM(
        model=facts.get("model", args.model),
        tokenizer=facts.get("tokenizer"),
        enforce_eager=True,
        dtype=args.dtype or facts.get("dtype", "float32"),
        block_size=args.block_size or facts.get("block_size", BLOCK_SIZE),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens or args.max_model_len,
        kv_transfer_config=transfer_config(args.connector, extra),
        enable_prefix_caching=args.prefix_caching,
        seed=0,
        **options,
    )
    startup_s = time.perf_counter() - started
    # The first requests of a process pay one-off costs (kernel selection for
    # new shapes, engines, threads); a short unrelated prompt takes them first.
    # --warmup-repeat 2 sends it twice: the second is a hit wherever the first
    # can fill one (vLLM's prefix cache, the memory connector), and with
    # --warmup-tokens set to a prompt's length modulo the block size (plus whole
    # blocks) every row's warm-up runs the forward shape of the timed hits.
    warmup = [TokensPrompt(prompt_token_ids=[5 + i for i in range(args.warmup_tokens)])]
    for _ in range(args.warmup_repeat):
        llm.generate(
            warmup, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
        )
    if args.drop_hooks_after_warmup:  # a platform that stops calling them
        suppress_layer_hooks()
    if args.pause_after_warmup:
        _wait_for_gate(args.pause_after_warmup, "ready", "go")
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
    )
    results = []
    salts = json.loads(args.cache_salts) if args.cache_salts else [None] * len(prompts)
    for index, tokens in enumerate([] if args.batch_only else prompts):
        if index in args.pause_before:  # the caller acts between prompts
            _wait_for_gate(args.pause_after_warmup, f"before-{index}", f"go-{index}")
        if external is not None:
            external.append(0)
        ttft_s = None
        if args.ttft:  # time a prefill plus one token first
            begin = time.perf_counter()
            llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)],
                SamplingParams(temperature=0.0, max_tokens=1),
                use_tqdm=False,
            )
            ttft_s = time.perf_counter() - begin
        waits = cpu_waits()
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salts[index] is not None:
            prompt["cache_salt"] = salts[index]
        begin = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        after = cpu_waits()
        results.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens or 0,
                "external_tokens": None if external is None else external[-1],
                "seconds": seconds,
                "ttft_s": ttft_s,
                **{k: round(after[k] - waits[k], 3) for k in waits},
            }
        )
    if args.pause_after_warmup:
        _wait_for_gate(args.pause_after_warmup, "done", "exit")
    report: dict[str, Any] = {"startup_s": startup_s, "results": results}
    if args.connector == "memory":
        from bench.harness import memory_connector

        report["memory_load_s"] = memory_connector.load_seconds()
    if tracer is not None:
        tracer.dump(args.trace, {"memory_load_s": report.get("memory_load_s")})
    if recorder is not None:
        with open(args.record_kv, "w") as f:
            json.dump(recorder.report(), f)
    if args.concurrent_batch or args.batch_only:
        begin = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=t) for t in prompts], params, use_tqdm=False
        )
        report["batch"] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "seconds": time.perf_counter() - begin,
        }
    if args.shutdown:  # the connectors' close() runs (and logs) here
        llm.llm_engine.engine_core.shutdown()
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
    build.add_argument(
        "--family", default="", help="a tiny_models family instead of Llama"
    )
    go = sub.add_parser("run")
    go.add_argument("--model", required=True)
    go.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    go.add_argument("--out", required=True)
    go.add_argument(
        "--connector",
        choices=("none", "npukv", "npukv-startup-fault", "example", "memory"),
        default="none",
    )
    go.add_argument("--extra", default="", help="kv_connector_extra_config as JSON")
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument(
        "--block-size", type=int, default=0, help="default: the model's, else 32"
    )
    go.add_argument(
        "--dtype", default="", help="model and KV dtype (default: the model's)"
    )
    go.add_argument(
        "--attention-backend", default="",
        help="vLLM's attention backend, e.g. CPU_MLA or AMX_MLA; auto: vLLM's "
        "choice (default: the model's, from build_family, else vLLM's)",
    )  # fmt: skip
    go.add_argument("--max-model-len", type=int, default=1024)
    go.add_argument(
        "--max-num-batched-tokens", type=int, default=0,
        help="tokens per step (default: --max-model-len); smaller chunks a prefill",
    )  # fmt: skip
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
        "--pretend-accelerator", action="store_true",
        help="the CPU backend reports kind npu (layerwise auto's device branch)",
    )  # fmt: skip
    go.add_argument(
        "--drop-hooks-after-warmup", action="store_true",
        help="suppress the layer hooks after the warm-up prompt",
    )  # fmt: skip
    go.add_argument(
        "--concurrent-batch", action="store_true", help="also run all prompts at once"
    )
    go.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's own prefix cache (on by default, as in production)",
    )
    go.add_argument(
        "--hma", choices=("on", "off"), help="force vLLM's hybrid KV cache manager"
    )
    go.add_argument(
        "--retention-interval", default="", metavar="TOKENS|dense",
        help="vLLM's prefix_cache_retention_interval: which Mamba and sliding "
        "boundaries its prefix cache keeps (default: vLLM's, prompt ends only)",
    )  # fmt: skip
    go.add_argument(
        "--kv-events-endpoint", default="", metavar="ZMQ",
        help="publish vLLM's KV cache events (and the connector's) on this "
        "ZeroMQ endpoint, topic 'kv' (--kv-events-config)",
    )  # fmt: skip
    go.add_argument(
        "--cache-salts", default="", metavar="JSON",
        help="a JSON list: each prompt's cache_salt (null: none), its tenant",
    )  # fmt: skip
    go.add_argument("--record-kv", default="", help="write saved/loaded KV digests")
    go.add_argument(
        "--trace", default="",
        help="time vLLM's and the connectors' steps (bench/harness/trace.py) into FILE",
    )  # fmt: skip
    go.add_argument(
        "--warmup-tokens", type=int, default=WARMUP_TOKENS,
        help="tokens of the warm-up prompt (tokens 5, 6, ...)",
    )  # fmt: skip
    go.add_argument(
        "--warmup-repeat", type=int, default=1, help="send the warm-up prompt N times"
    )
    go.add_argument(
        "--pause-after-warmup", default="", metavar="DIR",
        help="after the warm-up write DIR/ready and wait for DIR/go; after the "
        "prompts write DIR/done and wait for DIR/exit (to attach a profiler)",
    )  # fmt: skip
    go.add_argument(
        "--pause-before", type=int, action="append", default=[], metavar="I",
        help="before prompt I (0-based; repeatable) write DIR/before-I and wait "
        "for DIR/go-I (DIR: --pause-after-warmup's)",
    )  # fmt: skip
    go.add_argument(
        "--shutdown", action="store_true",
        help="shut the engine down before exiting (the connectors' close() runs)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "run" and args.pause_before and not args.pause_after_warmup:
        parser.error("--pause-before needs --pause-after-warmup DIR")
    if args.command == "build-model" and args.family:
        build_family(args.path, args.family, args.seed)
        return 0
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
