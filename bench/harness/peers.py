"""The processes and file operations of ``python -m bench peers``.

    python -m bench.harness.peers run --model DIR --prompts FILE --out FILE \
        --kv-config JSON [--block-size 64 --max-tokens 8 --warmup-tokens N]
    python -m bench.harness.peers fs-tier --dir DIR --out FILE

``run`` is one vLLM process with any ``KVTransferConfig`` (JSON; "" or
"null": none), vLLM's prefix cache on, as in production. After a warm-up
prompt (sent twice), each prompt is generated twice: first max_tokens=1,
timed (the TTFT of a fresh prompt: what the connector loads, nothing of
vLLM's own prefix cache, ``num_cached_tokens`` is the tokens it loaded), then
``--max-tokens`` greedy tokens (the prompt now a hit in vLLM's prefix cache,
which holds the loaded KV: the tokens say whether that KV was right). The
engine runs in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, set by the
caller): LMCache's import of numba must stay out of the process whose CPU
worker scans sys.modules (vLLM 0.32's CPU build).

``fs-tier`` drives vLLM's fs secondary tier's file I/O
(``vllm.v1.kv_offload.tiering.fs.io``: ``batch_store_block`` /
``batch_load_block``, the functions its FileSystemTierManager queues) directly,
without a GPU, on the blocks of one prompt's KV: what a restart, a corrupted
file, a capacity and a kill -9 do to it.

The rest are the parent's helpers: an LMCache server, a vLLM process that can
be killed mid-save, bytes on disk, a corrupted chunk file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.harness.processes import child_env

MODULE = "bench.harness.peers"
#: The overlay venv with LMCache (scripts/setup_lmcache.sh).
LMCACHE_VENV = ROOT / ".venv-lmcache"
#: The same hash seed in every process: LMCache's keys (and vLLM's block
#: hashes) start from vLLM's NONE_HASH, random per process otherwise.
HASH_SEED = "0"


# -- the parent's side -----------------------------------------------------------------


def lmcache_python() -> Path:
    return LMCACHE_VENV / "bin" / "python"


def have_lmcache() -> str:
    """Empty where .venv-lmcache imports lmcache, else why not."""
    py = lmcache_python()
    if not py.exists():
        return "no .venv-lmcache (bash scripts/setup_lmcache.sh)"
    probe = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
        capture_output=True, text=True, env=child_env(),
    )  # fmt: skip
    if probe.returncode != 0:
        return f".venv-lmcache: {probe.stderr.strip()[-200:]}"
    return ""


def env_for(python: Path | str) -> dict[str, str]:
    return child_env(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        PYTHONHASHSEED=HASH_SEED,
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
    )


def start_vllm(
    python: Path | str, work: Path, name: str, args: list[str]
) -> subprocess.Popen[bytes]:
    """``python -m bench.harness.peers run --out work/name.json args`` in its
    own session (kill_group ends it and the engine it spawned)."""
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            [str(python), "-m", MODULE, "run", "--out", str(out), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env_for(python),
            start_new_session=True,
        )  # fmt: skip
    finally:
        log.close()


def finish_vllm(
    proc: subprocess.Popen[bytes], work: Path, name: str, timeout_s: float = 1800
) -> dict[str, Any]:
    """Wait for a run; its report, or ``{"error": ...}`` with the log's tail."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        rc = -9
    out = work / f"{name}.json"
    if rc == 0 and out.exists():
        report: dict[str, Any] = json.loads(out.read_text())
        return report
    tail = (work / f"{name}.log").read_text(errors="replace")[-3000:]
    return {"error": f"rc {rc}", "log_tail": tail}


def run_vllm(
    python: Path | str, work: Path, name: str, args: list[str]
) -> dict[str, Any]:
    return finish_vllm(start_vllm(python, work, name, args), work, name)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s whole session (its engine core too), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (st_blocks, as du counts)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def file_count(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


#: Files that are no peer's KV data: our index and locks, configs.
_NOT_DATA = (".mdb", ".lock", ".json", "marker", "secret")


def largest_data_file(path: Path) -> Path | None:
    """The largest regular file under ``path`` that holds KV (not an index,
    lock or config file): the chunk file a corruption row damages."""
    best: tuple[int, str] | None = None
    for root, _, files in os.walk(path):
        for name in files:
            if any(tag in name for tag in _NOT_DATA):
                continue
            full = os.path.join(root, name)
            size = os.lstat(full).st_size
            if best is None or size > best[0]:
                best = (size, full)
    return Path(best[1]) if best else None


def corrupt(file: Path) -> tuple[int, int]:
    """Overwrite the middle half of ``file`` with 0x7f bytes (as float32:
    3.4e38, KV that cannot go unnoticed in the tokens) in place, size and
    name unchanged: (offset, length) written."""
    size = file.stat().st_size
    offset, length = size // 4, max(1, size // 2)
    with open(file, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\x7f" * length)
        handle.flush()
        os.fsync(handle.fileno())
    return offset, length


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port: int = sock.getsockname()[1]
        return port


class LMCacheServer:
    """``lmcache server`` (multi-process mode) with an fs L2 under
    ``base_path``: started fresh for every vLLM process that loads (an empty
    L1: a hit must come from the files, as after a restart)."""

    def __init__(self, base_path: Path, log: Path, chunk_size: int = 64) -> None:
        self.base_path, self.log, self.chunk_size = base_path, log, chunk_size
        self.port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": 60.0,
            },
        }

    def start(self, timeout_s: float = 180) -> None:
        self.base_path.mkdir(parents=True, exist_ok=True)
        l2 = json.dumps({"type": "fs", "base_path": str(self.base_path)})
        cmd = [
            str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--host", "localhost",
            "--port", str(self.port), "--http-port", str(self.http_port),
            "--chunk-size", str(self.chunk_size), "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--l2-adapter", l2, "--disable-observability", "--disable-metrics",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT,
                env=env_for(lmcache_python()), start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited: see {self.log}")
            try:
                with socket.create_connection(("localhost", self.port), timeout=1):
                    time.sleep(1.0)  # bound: let it finish starting
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"lmcache server not up in {timeout_s} s: see {self.log}")

    def stop(self, hard: bool = False) -> None:
        if self.proc is None:
            return
        if not hard and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        kill_group(self.proc)
        self.proc = None


# -- the child: one vLLM process -------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from bench.harness.vllm_run import cpu_waits

    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    raw = json.loads(args.kv_config) if args.kv_config else None
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_model_len,
        kv_transfer_config=KVTransferConfig(**raw) if raw else None,
        enable_prefix_caching=True,
        seed=0,
    )
    startup_s = time.perf_counter() - started
    warmup = [TokensPrompt(prompt_token_ids=[5 + i for i in range(args.warmup_tokens)])]
    for _ in range(2):
        llm.generate(
            warmup, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
        )
    one = SamplingParams(temperature=0.0, max_tokens=1)
    many = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for tokens in prompts:
        waits = cpu_waits()
        begin = time.perf_counter()
        (first,) = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False
        )
        ttft_s = time.perf_counter() - begin
        after = cpu_waits()
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)], many, use_tqdm=False
        )
        results.append(
            {
                "ttft_s": ttft_s,
                "loaded_tokens": first.num_cached_tokens or 0,
                "tokens": list(output.outputs[0].token_ids),
                **{k: round(after[k] - waits[k], 3) for k in waits},
            }
        )
    report = {"startup_s": startup_s, "results": results}
    with open(args.out, "w") as f:  # before shutdown: a hang there loses nothing
        json.dump(report, f)
    llm.llm_engine.engine_core.shutdown()
    return report


# -- the child: vLLM's fs tier's file I/O, driven directly -----------------------------


def _drop(path: Path) -> None:
    from bench.vllm_runs import drop_page_cache

    drop_page_cache(path)


def fs_tier(directory: Path, blocks: int, block_bytes: int) -> dict[str, Any]:
    """vLLM's fs tier's own store and load functions (the ones its
    FileSystemTierManager queues on its thread pool) on ``blocks`` blocks of
    ``block_bytes``, then our KVStore on the same blocks (``ours``): a write,
    a cold read (page cache dropped) and a warm one by a fresh reader (a
    restart), capacity (the fs tier takes none: 3 more rounds written, every
    file stays; ours: capacity one round), corruption (one block file's
    middle overwritten in place: is the load refused?)."""
    import mmap
    import random

    from vllm.v1.kv_offload.tiering.fs import io as fsio

    fs_dir = directory / "vllm_fs"
    fs_dir.mkdir(parents=True, exist_ok=True)
    use_direct = fsio.probe_o_direct(str(fs_dir))
    rng = random.Random(5)
    source = mmap.mmap(-1, blocks * block_bytes)
    source.write(rng.randbytes(blocks * block_bytes))
    view = memoryview(source)
    offsets = [i * block_bytes for i in range(blocks)]
    paths = [str(fs_dir / f"{i:04x}" / f"block{i}.bin") for i in range(blocks)]
    began = time.perf_counter()
    fsio.batch_store_block(paths, view, offsets, block_bytes, use_direct)
    store_s = time.perf_counter() - began
    found: dict[str, Any] = {
        "o_direct": use_direct, "have_c_extension": fsio._HAS_FSIO_C,
        "blocks": blocks, "block_bytes": block_bytes, "store_s": store_s,
        "fsync_calls_in_io_py": 0,
    }  # fmt: skip
    target = mmap.mmap(-1, blocks * block_bytes)
    for kind in ("cold", "warm"):
        if kind == "cold":
            _drop(fs_dir)
        began = time.perf_counter()
        fsio.batch_load_block(
            paths, memoryview(target), offsets, block_bytes, use_direct
        )
        found[f"load_{kind}_s"] = time.perf_counter() - began
    found["load_s"] = found["load_cold_s"]
    found["load_equal"] = target[:] == source[:]
    found["disk_bytes"] = disk_bytes(fs_dir)
    # corruption: the middle of block 0 overwritten, size unchanged
    corrupt(Path(paths[0]))
    target2 = mmap.mmap(-1, blocks * block_bytes)
    try:
        fsio.batch_load_block(
            paths, memoryview(target2), offsets, block_bytes, use_direct
        )
        found["corrupt_load"] = "loaded without an error"
        found["corrupt_bytes_differ"] = target2[:block_bytes] != source[:block_bytes]
    except OSError as exc:
        found["corrupt_load"] = f"refused: {exc}"
        found["corrupt_bytes_differ"] = False
    # capacity: the tier takes none; 3 more rounds of new blocks, all kept
    before = disk_bytes(fs_dir)
    for round_ in range(3):
        more = [str(fs_dir / f"r{round_}" / f"block{i}.bin") for i in range(blocks)]
        fsio.batch_store_block(more, view, offsets, block_bytes, use_direct)
    found["disk_bytes_one_round"] = before
    found["disk_bytes_after_3x_more"] = disk_bytes(fs_dir)
    io_source = Path(fsio.__file__).read_text()
    found["fsync_calls_in_io_py"] = io_source.count("fsync")
    found["checksum_in_io_py"] = bool(
        re.search(r"checksum|crc32|xxh|hashlib", io_source)
    )
    native = sorted(Path(fsio.__file__).parents[4].glob("fs_io_C*.so"))
    found["fs_io_C"] = native[0].name if native else None
    if native:  # its imported symbols: no fsync, no fdatasync
        symbols = native[0].read_bytes()
        found["fs_io_C_imports_fsync"] = b"fsync" in symbols
    found["ours"] = ours_direct(directory / "ours", source, blocks, block_bytes)
    return found


def ours_direct(
    directory: Path, source: Any, blocks: int, block_bytes: int
) -> dict[str, Any]:
    """Our KVStore on the fs tier's blocks: one namespace of one U8 part of
    ``block_bytes`` per block, 64 tokens a block, ``capacity`` one round (plus
    1 MiB: a chunk's header; a chunk larger than the capacity is not kept)."""
    import numpy as np

    from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec, StoreConfig

    spec = NamespaceSpec(
        model="bench-peers-fs", block_size=64, kv_dtype="U8",
        layers=(LayerSpec("l0", (PartSpec("kv", "U8", (block_bytes,)),)),),
    )  # fmt: skip
    # one round and its chunk's header room: 3 more rounds are 3x it
    capacity = blocks * block_bytes + (1 << 20)
    config = StoreConfig(cache_dir=str(directory), capacity=capacity)
    data = np.frombuffer(source, dtype=np.uint8).reshape(blocks, block_bytes)
    found: dict[str, Any] = {"capacity_bytes": capacity}
    store = KVStore(config, spec)
    keys = store.keys_for(np.arange(blocks * 64))
    began = time.perf_counter()
    result = store.put(keys, {"l0.kv": data})
    found["store_s"] = time.perf_counter() - began
    found["stored"] = result.stored
    store.close()
    out = np.zeros_like(data)
    for kind in ("cold", "warm"):
        if kind == "cold":
            _drop(directory)
        reader = KVStore(config, spec)  # a fresh reader: a restart
        began = time.perf_counter()
        ok = reader.read(keys, {"l0.kv": out})
        found[f"load_{kind}_s"] = time.perf_counter() - began
        reader.close()
    found["load_equal"] = bool(all(ok)) and bool((out == data).all())
    found["disk_bytes"] = disk_bytes(directory)
    damaged = largest_data_file(directory)
    assert damaged is not None
    corrupt(damaged)
    _drop(directory)
    reader = KVStore(config, spec)
    out2 = np.zeros_like(data)
    ok2 = reader.read(keys, {"l0.kv": out2})
    reader.close()
    found["corrupt_blocks_refused"] = ok2.count(False)
    found["corrupt_blocks_loaded"] = ok2.count(True)
    found["corrupt_loaded_equal"] = bool(
        all((out2[i] == data[i]).all() for i, hit in enumerate(ok2) if hit)
    )
    # capacity in a directory of its own (the damaged chunk above sits in
    # quarantine/, outside the capacity): one round, then 3 more
    config = StoreConfig(cache_dir=str(directory) + "_capacity", capacity=capacity)
    store = KVStore(config, spec)
    store.put(keys, {"l0.kv": data})
    for round_ in range(3):
        more = store.keys_for(np.arange(blocks * 64) + (round_ + 1) * 1_000_003)
        store.put(more, {"l0.kv": data})
    store.close()
    found["disk_bytes_after_3x_more"] = disk_bytes(Path(config.cache_dir))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("--model", required=True)
    go.add_argument("--prompts", required=True)
    go.add_argument("--out", required=True)
    go.add_argument("--kv-config", default="")
    go.add_argument("--block-size", type=int, default=64)
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument("--max-model-len", type=int, default=4096)
    go.add_argument("--warmup-tokens", type=int, default=100)
    fs = sub.add_parser("fs-tier")
    fs.add_argument("--dir", required=True)
    fs.add_argument("--out", required=True)
    fs.add_argument("--blocks", type=int, default=16)
    fs.add_argument("--block-bytes", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    if args.command == "run":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        run(args)
        return 0
    result = fs_tier(Path(args.dir), args.blocks, args.block_bytes)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())
