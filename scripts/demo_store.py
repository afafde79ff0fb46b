"""Store-level demo: two processes share one cache directory.

A writer process saves the KV of several synthetic prompts through put_async
(a model of 16 layers, 8 KV heads of 128 dims, fp16, 16-token blocks: 1 MiB per
block) while a reader process, started at the same time, waits for each
prompt's prefix to appear, reads it back block by block into its own buffers and
checks every byte against content it derives from the block keys. Then both
print what they did and their throughput, and the directory is verified.

Usage: python scripts/demo_store.py [--dir PATH] [--prompts N] [--blocks N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time

import numpy as np

from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec, StoreConfig

BLOCK_TOKENS = 16
SPEC = NamespaceSpec(
    model="demo-llama-16L",
    block_size=BLOCK_TOKENS,
    kv_dtype="float16",
    layers=tuple(
        LayerSpec(
            f"model.layers.{i}.self_attn.attn",
            (PartSpec("k", "F16", (16, 8, 128)), PartSpec("v", "F16", (16, 8, 128))),
        )
        for i in range(16)
    ),
)


def prompt_tokens(prompt: int, blocks: int) -> np.ndarray:
    """Prompts share their first quarter: a common system prompt."""
    shared = np.arange(blocks * BLOCK_TOKENS // 4)
    own = np.random.default_rng(prompt).integers(0, 32000, blocks * BLOCK_TOKENS)
    return np.concatenate([shared, own[shared.size :]])


def block_content(keys: list[bytes]) -> dict[str, np.ndarray]:
    """KV bytes derived from the keys: any process can check what it reads."""
    out = {}
    for layer in SPEC.layers:
        for part in layer.parts:
            rows = [
                np.frombuffer(
                    np.random.default_rng(
                        [*key[:8], *layer.name.encode(), *part.name.encode()]
                    ).bytes(part.row_bytes),
                    np.float16,
                ).reshape(part.row_shape)
                for key in keys
            ]
            out[f"{layer.name}.{part.name}"] = np.stack(rows)
    return out


def writer(config: StoreConfig, prompts: int, blocks: int, report: mp.Queue) -> None:
    """Saves as the connector does: put_async stages each prompt in the ring and
    returns; the background writer publishes; the reader sees each prompt once
    its chunk is committed."""
    with KVStore(config, SPEC) as store:
        store.prepare_async()  # ring + writer at start-up, as a server would
        staged, producer_s = 0, 0.0
        start = time.perf_counter()
        for prompt in range(prompts):
            keys = store.keys_for(prompt_tokens(prompt, blocks))
            tensors = block_content(keys)
            begin = time.perf_counter()
            result = store.put_async(keys, tensors)
            producer_s += time.perf_counter() - begin
            staged += result.queued * SPEC.block_bytes
            print(
                f"[writer] prompt {prompt}: staged {result.queued} blocks, skipped "
                f"{result.skipped} already stored or in flight (shared prefix), "
                f"dropped {result.dropped}",
                flush=True,
            )
        store.flush()
        total_s = time.perf_counter() - start
        print(
            f"[writer] put_async calls took {producer_s * 1e3:.0f} ms in all "
            f"(the forward pass's share); flushed to disk after {total_s:.2f} s",
            flush=True,
        )
        report.put(("writer", staged, producer_s))


def reader(config: StoreConfig, prompts: int, blocks: int, report: mp.Queue) -> None:
    with KVStore(config, SPEC) as store:
        read, seconds, checked = 0, 0.0, 0
        for prompt in range(prompts):
            keys = store.keys_for(prompt_tokens(prompt, blocks))
            deadline = time.monotonic() + 120
            while store.lookup(keys) < len(keys):  # the writer has not got here yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prompt {prompt} never appeared")
                time.sleep(0.01)
            out = {
                f"{lay.name}.{p.name}": np.empty((len(keys), *p.row_shape), np.float16)
                for lay in SPEC.layers
                for p in lay.parts
            }
            start = time.perf_counter()
            ok = store.read(keys, out)
            seconds += time.perf_counter() - start
            expected = block_content(keys)
            assert all(ok), f"prompt {prompt}: {ok.count(False)} blocks missed"
            for name, array in expected.items():
                assert np.array_equal(out[name].view(np.uint16), array.view(np.uint16))
            read += len(keys) * SPEC.block_bytes
            checked += len(keys)
            print(f"[reader] prompt {prompt}: {len(keys)} blocks read and verified")
        report.put(("reader", read, seconds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="cache directory (default: a temp dir)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=40, help="blocks per prompt")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="npukv-demo-", dir="/var/tmp")
    config = StoreConfig(cache_dir=root, capacity="4GiB")
    ctx = mp.get_context("spawn")
    report: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=fn, args=(config, args.prompts, args.blocks, report))
        for fn in (writer, reader)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        print("demo FAILED: a process exited with an error")
        return 1
    print(f"\nmodel: {len(SPEC.layers)} layers, {SPEC.block_bytes >> 10} KiB per block")
    for _ in procs:
        role, nbytes, seconds = report.get()
        print(
            f"{role:>6}: {nbytes / 2**20:8.1f} MiB in {seconds:6.3f} s "
            f"= {nbytes / seconds / 1e9:5.2f} GB/s (put_async/read calls only)"
        )
    with KVStore(config, SPEC) as store:
        stats = store.stats()
        problems = store.check(verify_data=True)
    print(
        f"store: {stats.num_chunks} chunks, {stats.num_blocks} blocks, "
        f"{stats.total_bytes / 2**20:.1f} MiB on disk in {root}"
    )
    print(f"check(verify_data=True): {len(problems)} problem(s)")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
