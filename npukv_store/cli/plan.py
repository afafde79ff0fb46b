"""``npukv plan CONFIG_JSON --tp N``: what a deployment of a model takes.

Runs in: the ``npukv`` process; reads one file (a Hugging Face ``config.json``,
or the model directory holding it), touches no cache.

For a model, its TP, block size and capacity, it prints the blocks, chunks,
index size, staging ring and host memory, and how many prompts the capacity
reaches. Every number comes from the code that sizes the real thing
(:mod:`npukv_store.store.sizing`: the connector's namespace layout, the chunk
format's header encoder, the saver's batches, the workers' auto ring).
Reference: docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from npukv_store.cli import render
from npukv_store.cli.render import Pairs, exact_bytes, human_bytes
from npukv_store.config import StoreConfig, parse_size
from npukv_store.errors import NpuKVError
from npukv_store.store.model_shape import ModelShape
from npukv_store.store.sizing import DEFAULT_BATCHED_TOKENS, Plan, plan

_DEFAULTS = StoreConfig(cache_dir="/unused")


class PlanInputError(NpuKVError):
    """The model file cannot be read as a config.json (exit 2)."""


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "model", metavar="CONFIG_JSON",
        help="the model's config.json, or the model directory holding it",
    )  # fmt: skip
    cmd.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    cmd.add_argument("--block-size", type=int, default=128, help="tokens per block")
    cmd.add_argument(
        "--capacity", default="500GiB", metavar="SIZE", help="the cache's capacity"
    )
    cmd.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_BATCHED_TOKENS,
        metavar="N", help="vLLM's tokens per step (sizes the ring)",
    )  # fmt: skip
    cmd.add_argument(
        "--kv-dtype", default="", metavar="DTYPE",
        help="the KV cache dtype (vLLM --kv-cache-dtype); default torch_dtype",
    )  # fmt: skip
    cmd.add_argument(
        "--prompt-tokens", type=int, default=32768, metavar="N",
        help="the prompt length 'prompts reachable' and the loader's slots count",
    )  # fmt: skip
    cmd.add_argument(
        "--chunk-target-size", default=_DEFAULTS.chunk_target_size, metavar="SIZE"
    )
    cmd.add_argument(
        "--index-map-size", default=_DEFAULTS.index_map_size, metavar="SIZE"
    )
    cmd.add_argument("--json", action="store_true", help="one JSON object")


def load_model_config(path: str) -> dict[str, Any]:
    """The JSON object of ``path`` (a config.json, or a directory holding one).

    Raises:
        PlanInputError: missing, unreadable, not JSON, or not an object.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            body = json.load(handle)
    except FileNotFoundError:
        raise PlanInputError(f"{path}: no such file; expected a config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanInputError(
            f"{path}: unreadable ({exc}); expected a config.json"
        ) from None
    except json.JSONDecodeError as exc:
        raise PlanInputError(
            f"{path}: not JSON ({exc.msg} at line {exc.lineno}); expected a "
            "model's config.json"
        ) from None
    if not isinstance(body, dict):
        raise PlanInputError(
            f"{path}: a JSON {type(body).__name__}, expected a model's "
            "config.json object"
        )
    return body


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan the arguments ask for.

    Raises:
        NpuKVError: a bad file, field or value, in one line.
    """
    for flag in ("tp", "block_size", "max_num_batched_tokens", "prompt_tokens"):
        value = getattr(args, flag)
        if value < 1:
            option = "--" + flag.replace("_", "-")
            raise PlanInputError(f"{option}: found {value}, expected >= 1")
    body = load_model_config(args.model)
    name = str(
        body.get("_name_or_path") or os.path.basename(os.path.abspath(args.model))
    )
    shape = ModelShape.from_hf_config(body, name=name, kv_dtype=args.kv_dtype)
    chunk = parse_size(args.chunk_target_size, key="--chunk-target-size")
    if chunk < 1:
        raise PlanInputError("--chunk-target-size: found 0, expected a size > 0")
    return plan(
        shape,
        tp=args.tp,
        block_size=args.block_size,
        capacity=parse_size(args.capacity, key="--capacity"),
        chunk_target_size=chunk,
        batched_tokens=args.max_num_batched_tokens,
        prompt_tokens=args.prompt_tokens,
        index_map_size=parse_size(args.index_map_size, key="--index-map-size"),
    )


def plan_sections(p: Plan) -> list[Pairs]:
    """The plan as the text ``npukv plan`` prints."""
    if p.attention == "MLA":
        layout = "MLA: the latent KV is the same on every rank, stored once"
    else:
        layout = f"GQA: {p.heads_per_rank} KV head(s) per rank, one namespace per rank"
        if p.replicated_heads:
            layout += f" (heads replicated: TP {p.tp} > the model's KV heads)"
    model = Pairs("model", [
        ("model", p.model),
        ("layout", layout),
        ("namespaces", f"{p.namespaces}"),
        ("block", f"{p.block_size} tokens, {exact_bytes(p.block_bytes)} per namespace"),
        ("stored per token", f"{p.stored_bytes_per_token:,} B (all namespaces)"),
    ])  # fmt: skip
    store = Pairs("store", [
        ("capacity", exact_bytes(p.capacity)),
        ("chunk", f"{p.blocks_per_chunk} blocks, {exact_bytes(p.chunk_bytes)}"),
        ("blocks (index keys)", f"{p.blocks:,}"),
        ("chunks", f"{p.chunks:,} ({p.chunks_one_block:,} if every chunk held "
                   "one block: decode saves)"),
        ("tokens cached", f"{p.tokens_cached:,}"),
        (f"prompts of {p.prompt_tokens:,} tokens", f"{p.prompts_reachable:,}"),
    ])  # fmt: skip
    fits = "fits" if p.index_file_bytes <= p.index_map_size else "TOO SMALL"
    index = Pairs("index", [
        ("pages in use", f"{human_bytes(p.index_bytes_in_use)} "
                         f"({human_bytes(p.index_bytes_one_block)} with "
                         "one-block chunks)"),
        ("file, at most", human_bytes(p.index_file_bytes)),
        ("index_map_size", f"{human_bytes(p.index_map_size)}: {fits}"),
    ])  # fmt: skip
    memory = Pairs("memory", [
        ("a step stages", f"{human_bytes(p.step_stage_bytes)} per worker "
                          f"({p.batched_tokens:,} tokens)"),
        ("ring (auto) per worker",
         f"{human_bytes(p.ring_bytes_per_worker)} of /dev/shm"),
        ("rings per node", f"{human_bytes(p.shm_bytes_per_node)} of /dev/shm "
                           f"({p.tp} workers)"),
        ("loader slots per worker", f"{human_bytes(p.loader_slot_bytes_per_worker)} "
                                    f"pinned ({p.prompt_tokens:,}-token hit)"),
        ("host per worker", human_bytes(p.host_bytes_per_worker)),
        ("host per node", human_bytes(p.host_bytes_per_node)),
        ("processes on the directory", f"{p.processes} (workers and the scheduler)"),
    ])  # fmt: skip
    return [model, store, index, memory]


def cmd_plan(args: argparse.Namespace) -> int:
    """For a model (its config.json), TP, block size and capacity: the blocks,
    chunks, index size, staging ring and host memory, and the prompts the
    capacity reaches, from the code that sizes the real thing."""
    result = make_plan(args)
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
    else:
        render.emit(plan_sections(result))
    return 0
