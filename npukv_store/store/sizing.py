"""Sizes that follow from a deployment: the staging ring a step needs, the
blocks a chunk holds, and what a capacity means in blocks, chunks, index and
host memory.

Runs in: a vLLM worker at registration (ring_request, save_batch_target), its
save path (blocks_per_chunk), ``npukv plan`` and the benchmarks (plan), the
maintenance job (recorded_map_size). Pure but for recorded_map_size; chunk sizes
come from the chunk format's own header encoder and layout.

    blocks_per_chunk()  - blocks one save batch (one chunk file) holds
    chunk_file_bytes()  - bytes of a chunk file of n blocks, header included
    step_stage_bytes()  - ring bytes one step's saves take at most
    ring_request()      - an auto ring's wanted size, floor and sharers
    save_batch_target() - the chunk size save batches aim for in a given ring
    plan()              - everything ``npukv plan`` prints, as a Plan
    recorded_map_size() - the index map size the servers use (for maintenance)

The ring of an auto ``ring_size`` holds :data:`STEPS_STAGED` steps (the writer
writes one while the forward stages the next), clamped to
[:data:`RING_AUTO_MIN`, :data:`RING_AUTO_MAX`]: docs/decisions/0062.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import lmdb

from npukv_store.errors import NpuKVError
from npukv_store.io.ring import ALIGN
from npukv_store.io.ring_sizing import RingRequest
from npukv_store.spec import NamespaceSpec
from npukv_store.store.directory import CacheDir
from npukv_store.store.envs import open_env, release_env
from npukv_store.store.format import MAX_CHUNK_BLOCKS, ChunkLayout, encode_header
from npukv_store.store.model_shape import ModelShape

#: Steps of saves an auto ring holds: one being written, one being staged.
STEPS_STAGED = 2
#: An auto ring is at least this (a tiny model's step is far smaller; what the
#: ring then costs is small against vLLM's own memory) ...
RING_AUTO_MIN = 64 << 20
#: ... and at most this per worker: 16 workers of a node take 64 GiB of RAM.
#: A DeepSeek-V3 step of 16384 tokens stages 1.15 GB: two fit.
RING_AUTO_MAX = 4 << 30
#: LMDB pages in use per stored block key and per chunk, measured on the real
#: Index at 10^4 to 10^7 keys: 56.7 B per key row, 273 B per chunk record and
#: 27 B per LRU row (99.5 B per key at 7 rows per chunk; docs/decisions/0062,
#: from the scale review of issue 27).
INDEX_BYTES_PER_KEY = 57
INDEX_BYTES_PER_CHUNK = 300
#: A bulk-built index file held 1.8-2.4x its pages in use (free pages).
INDEX_FILE_OVER_USE = 2.4
#: vLLM's default max_num_batched_tokens for an OpenAI server on a GPU/NPU.
DEFAULT_BATCHED_TOKENS = 8192
#: A creator string as long as a real one (pid@host), for header sizes.
_CREATOR = "4194304@" + "h" * 32


def blocks_per_chunk(block_bytes: int, chunk_target_size: int) -> int:
    """Blocks of ``block_bytes`` one save batch (one chunk file) holds when
    batches aim for ``chunk_target_size``: at least 1, at most the format's
    :data:`MAX_CHUNK_BLOCKS`."""
    return max(1, min(MAX_CHUNK_BLOCKS, chunk_target_size // block_bytes))


def chunk_file_bytes(spec: NamespaceSpec, n_blocks: int) -> int:
    """Bytes of a chunk file of ``n_blocks`` blocks of ``spec``: header, data,
    checksum table (as encode_header and ChunkLayout lay it out)."""
    keys = [bytes(16)] * n_blocks
    header = encode_header(spec, "0" * 32, keys, creator=_CREATOR, created_ns=0)
    return ChunkLayout(spec, n_blocks, len(header)).file_size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def step_stage_bytes(
    specs: Sequence[NamespaceSpec], batched_tokens: int, chunk_target_size: int
) -> int:
    """Ring bytes one step's saves take at most: every block its
    ``batched_tokens`` tokens can fill, in every namespace this worker saves
    (a hybrid model's groups), cut into batches as the saver cuts them, each
    region page-aligned as the ring gives it."""
    total = 0
    for spec in specs:
        blocks = -(-batched_tokens // spec.block_size)
        per_chunk = blocks_per_chunk(spec.block_bytes, chunk_target_size)
        full, rest = divmod(blocks, per_chunk)
        if full:
            total += full * _aligned(chunk_file_bytes(spec, per_chunk))
        if rest:
            total += _aligned(chunk_file_bytes(spec, rest))
    return total


def ring_request(
    specs: Sequence[NamespaceSpec],
    batched_tokens: int,
    chunk_target_size: int,
    sharers: int = 1,
) -> RingRequest:
    """What a worker's auto ring should be: :data:`STEPS_STAGED` steps of
    ``batched_tokens`` (vLLM's max_num_batched_tokens), clamped to
    [:data:`RING_AUTO_MIN`, :data:`RING_AUTO_MAX`]; never less than two
    one-block batches, the floor below which no save could be staged."""
    step = step_stage_bytes(specs, batched_tokens, chunk_target_size)
    floor = STEPS_STAGED * max(_aligned(chunk_file_bytes(s, 1)) for s in specs)
    wanted = min(max(STEPS_STAGED * step, RING_AUTO_MIN), RING_AUTO_MAX)
    return RingRequest(max(wanted, floor), floor, max(1, sharers))


def save_batch_target(
    specs: Sequence[NamespaceSpec], chunk_target_size: int, ring_bytes: int
) -> int:
    """The chunk size save batches aim for in a ring of ``ring_bytes``:
    ``chunk_target_size``, or less where the ring could not hold
    :data:`STEPS_STAGED` such batches (a small /dev/shm): a batch larger than
    the ring would be dropped every time; smaller chunks cost index rows."""
    room = ring_bytes // STEPS_STAGED
    target = chunk_target_size
    for spec in specs:
        n = blocks_per_chunk(spec.block_bytes, target)
        while n > 1 and _aligned(chunk_file_bytes(spec, n)) > room:
            n = max(1, n * room // _aligned(chunk_file_bytes(spec, n)))
            target = min(target, n * spec.block_bytes)
            n = blocks_per_chunk(spec.block_bytes, target)
    return target


@dataclass(frozen=True, slots=True)
class Plan:
    """What a deployment of a model takes (``npukv plan``); bytes unless named."""

    model: str
    attention: str  # "MLA" or "GQA"
    tp: int
    block_size: int
    capacity: int
    namespaces: int
    heads_per_rank: int
    replicated_heads: bool
    block_bytes: int  # one block of one namespace (rank)
    stored_bytes_per_token: int  # every namespace together
    blocks_per_chunk: int
    chunk_bytes: int
    blocks: int  # index keys, every namespace together
    chunks: int
    chunks_one_block: int  # when saves make one-block chunks (save_decode)
    tokens_cached: int  # distinct tokens the capacity holds
    prompt_tokens: int
    prompts_reachable: int
    index_bytes_in_use: int
    index_bytes_one_block: int  # in use with one-block chunks
    index_file_bytes: int
    index_map_size: int
    batched_tokens: int
    step_stage_bytes: int
    ring_bytes_per_worker: int
    shm_bytes_per_node: int
    loader_slot_bytes_per_worker: int
    host_bytes_per_worker: int
    host_bytes_per_node: int
    processes: int  # on the cache directory: the workers and the scheduler

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    shape: ModelShape,
    *,
    tp: int,
    block_size: int,
    capacity: int,
    chunk_target_size: int = 64 << 20,
    batched_tokens: int = DEFAULT_BATCHED_TOKENS,
    prompt_tokens: int = 32768,
    prefetch_depth: int = 2,
    index_map_size: int = 8 << 30,
) -> Plan:
    """What ``capacity`` bytes of ``shape``'s KV at TP ``tp`` mean: the
    namespaces' specs as the connector makes them, chunks as the saver cuts
    them, the auto ring the workers make, and the loader's pinned slots
    (``prefetch_depth`` layers of a ``prompt_tokens`` hit)."""
    specs = shape.rank_specs(tp, block_size)
    spec = specs[0]
    per_chunk = blocks_per_chunk(spec.block_bytes, chunk_target_size)
    chunk = chunk_file_bytes(spec, per_chunk)
    share = capacity // len(specs)  # each namespace's part of the capacity
    chunks_each = share // chunk
    blocks = chunks_each * per_chunk * len(specs)
    one_block = len(specs) * (share // chunk_file_bytes(spec, 1))
    tokens = chunks_each * per_chunk * block_size
    step = step_stage_bytes([spec], batched_tokens, chunk_target_size)
    ring = ring_request([spec], batched_tokens, chunk_target_size, tp).wanted
    layer_bytes = spec.layers[0].row_bytes
    slots = prefetch_depth * math.ceil(prompt_tokens / block_size) * layer_bytes
    in_use = blocks * INDEX_BYTES_PER_KEY + chunks_each * len(specs) * (
        INDEX_BYTES_PER_CHUNK
    )
    in_use_one = one_block * (INDEX_BYTES_PER_KEY + INDEX_BYTES_PER_CHUNK)
    return Plan(
        model=shape.name,
        attention="MLA" if shape.mla else "GQA",
        tp=tp,
        block_size=block_size,
        capacity=capacity,
        namespaces=len(specs),
        heads_per_rank=shape.heads_per_rank(tp),
        replicated_heads=not shape.mla and tp > shape.kv_heads,
        block_bytes=spec.block_bytes,
        stored_bytes_per_token=len(specs) * spec.block_bytes // block_size,
        blocks_per_chunk=per_chunk,
        chunk_bytes=chunk,
        blocks=blocks,
        chunks=chunks_each * len(specs),
        chunks_one_block=one_block,
        tokens_cached=tokens,
        prompt_tokens=prompt_tokens,
        prompts_reachable=tokens // prompt_tokens,
        index_bytes_in_use=in_use,
        index_bytes_one_block=in_use_one,
        index_file_bytes=int(max(in_use, in_use_one) * INDEX_FILE_OVER_USE),
        index_map_size=index_map_size,
        batched_tokens=batched_tokens,
        step_stage_bytes=step,
        ring_bytes_per_worker=ring,
        shm_bytes_per_node=ring * tp,
        loader_slot_bytes_per_worker=slots,
        host_bytes_per_worker=ring + slots,
        host_bytes_per_node=(ring + slots) * tp,
        processes=tp + 1,
    )


#: The two shapes of issue 27's node (fields of their config.json), for the
#: benchmarks: ``plan(ModelShape.from_hf_config(REFERENCE_MODELS[name]), ...)``.
REFERENCE_MODELS: dict[str, dict[str, Any]] = {
    "deepseek-v3": {
        "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "torch_dtype": "bfloat16",
    },
    "qwen3-235b-a22b": {
        "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    },
}  # fmt: skip


def default_memory(model: str, tp: int, **overrides: Any) -> dict[str, int]:
    """Per process and per node, what a TP ``tp`` engine of a
    :data:`REFERENCE_MODELS` shape takes with the defaults (auto ring, block
    128, 8192 batched tokens, prefetch 2, a 32k-token hit): for the scale
    benchmark's /dev/shm and pinned host memory figures."""
    shape = ModelShape.from_hf_config(REFERENCE_MODELS[model], name=model)
    settings: dict[str, Any] = {"block_size": 128, "capacity": 14 * 10**12}
    result = plan(shape, tp=tp, **(settings | overrides))
    return {
        "ring_bytes_per_worker": result.ring_bytes_per_worker,
        "shm_bytes_per_node": result.shm_bytes_per_node,
        "loader_slot_bytes_per_worker": result.loader_slot_bytes_per_worker,
        "host_bytes_per_worker": result.host_bytes_per_worker,
        "host_bytes_per_node": result.host_bytes_per_node,
    }


def recorded_map_size(cdir: CacheDir, default: int) -> int:
    """The map size to open ``cdir``'s index with in a tool (the maintenance
    job): the largest any process used on it, which LMDB records in the file
    (every commit writes the larger of the recorded and its own; an env opened
    with map size 0 takes the recorded one), and never below ``default``: a
    server configured above the default (``index_map_size``) keeps its
    headroom in maintenance, and a missing or unreadable index is rebuilt with
    the default as before.
    """
    if cdir.lstat(os.path.join("index", "data.mdb")) is None:
        return default
    try:
        env = open_env(cdir.index_path, 0, False, cdir.access)
    except (lmdb.Error, OSError, NpuKVError):
        return default  # recovery will say what is wrong, or rebuild
    try:
        recorded = int(env.info()["map_size"])
    finally:
        release_env(cdir.index_path)
    return max(recorded, default)
