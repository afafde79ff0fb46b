"""The runs and measurements bench/vllm.py and bench/cold_hit.py share: the
geometry of the benchmark (model, prompts, each row's harness arguments), one
vLLM process per row (``python -m bench.harness.vllm_run``), the page-cache
drop, the raw cold read behind the disk bound, and the idle-step timing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.processes import child_env, python_module
from bench.harness.vllm_run import BLOCK_SIZE, WARMUP_TOKENS, ensure_model

__all__ = ["BLOCK_SIZE", "WARMUP_TOKENS"]

#: The harness each row runs (``python -m HARNESS run ...``).
HARNESS = "bench.harness.vllm_run"


def harness(
    work: Path, name: str, args: list[str], *, prefix: Iterable[str] = ()
) -> dict[str, Any]:
    """One vLLM process (``python -m bench.harness.vllm_run run``), its
    report; ``prefix`` runs it under another command (py-spy)."""
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = work / f"{name}.json"
    with open(work / f"{name}.log", "wb") as log:
        rc = subprocess.run(
            [*prefix, *python_module(HARNESS, "run", "--out", str(out), *args)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800,
        ).returncode  # fmt: skip
    if rc != 0:
        tail = (work / f"{name}.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"vLLM run {name} failed (rc {rc}):\n{tail}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@dataclass
class Geometry:
    """Model, prompts and each row's harness arguments of one benchmark run."""

    work: Path
    quick: bool
    num_prompts: int
    prompt_tokens: int
    decode_tokens: int
    model_shape: list[str]
    prompts: list[list[int]] = field(default_factory=list)
    decode_prompts: list[list[int]] = field(default_factory=list)

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def common(self) -> list[str]:
        # vLLM's prefix cache off, so every hit is a connector's (the floor
        # run turns it on); the CPU attention backend continues a prefill
        # exactly, so loads stay on (load_without_prefix_caching)
        max_len = str(max(4096, self.prompt_tokens + 64))
        return [
            "--model", str(self.model), "--max-model-len", max_len,
            "--no-prefix-caching", "--warmup-tokens", str(self.warmup_tokens),
            "--warmup-repeat", "2",
        ]  # fmt: skip

    @property
    def warmup_tokens(self) -> int:
        """The warm-up prompt: whole blocks, then as many tokens as a timed
        hit computes (a prompt's tokens past its loadable blocks). Sent twice
        (``--warmup-repeat 2``): in every row the warm-up then runs the timed
        requests' code paths and forward shapes once before the clock starts,
        a hit from the store or from vLLM's prefix cache included (the first
        use of a shape builds oneDNN kernels: 3-20 ms in the first timed hit
        otherwise)."""
        tail = self.prompt_tokens - self.stored_tokens_per_prompt
        return WARMUP_TOKENS // BLOCK_SIZE * BLOCK_SIZE + tail

    @property
    def ttft(self) -> list[str]:
        """Each prompt once, max_tokens=1."""
        prompts = str(self.work / "prompts.json")
        return [*self.common, "--prompts", prompts, "--max-tokens", "1"]

    @property
    def twice(self) -> list[str]:
        """Each prompt twice in a row, max_tokens=1: the second is a hit in
        whatever the first filled (vLLM's prefix cache, the memory connector)."""
        prompts = str(self.work / "twice.json")
        return [*self.common, "--prompts", prompts, "--max-tokens", "1"]

    @property
    def floor(self) -> list[str]:
        return [*self.twice, "--prefix-caching"]

    @property
    def memory(self) -> list[str]:
        return [*self.twice, "--connector", "memory"]

    @property
    def decode(self) -> list[str]:
        return [
            *self.common, "--prompts", str(self.work / "decode.json"),
            "--max-tokens", str(self.decode_tokens), "--batch-only",
        ]  # fmt: skip

    def ours(self, cache: str, **extra: object) -> list[str]:
        config = {
            "cache_dir": str(self.work / cache), "ring_size": "256MiB",
            "load_without_prefix_caching": True, **extra,
        }  # fmt: skip
        return ["--connector", "npukv", "--extra", json.dumps(config)]

    @property
    def example(self) -> list[str]:
        path = str(self.work / "example")
        extra = json.dumps({"shared_storage_path": path})
        return ["--connector", "example", "--extra", extra]

    @property
    def stored_tokens_per_prompt(self) -> int:
        """Tokens of KV a hit of one prompt loads (full blocks, never the last)."""
        return (self.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE

    @property
    def stored_tokens(self) -> int:
        """Tokens of KV the storing runs write: every prompt's full blocks and
        the warm-up prompt's."""
        full = self.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        return self.num_prompts * full + self.warmup_tokens // BLOCK_SIZE * BLOCK_SIZE


def geometry(
    work: Path | None,
    quick: bool,
    num_prompts: int = 0,
    prompt_tokens: int = 0,
    decode_tokens: int = 0,
) -> Geometry:
    """The benchmark's geometry in ``work`` (default: a new temporary
    directory): the model built, the prompt files written."""
    work = work or Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    shape = (
        ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "4"]
        if quick
        else ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "8"]
    )
    geo = Geometry(
        work, quick, num_prompts or (3 if quick else 5),
        prompt_tokens or (1000 if quick else 2000),
        decode_tokens or (32 if quick else 256), shape,
    )  # fmt: skip
    ensure_model(geo.model, shape)
    rng = random.Random(11)
    geo.prompts = [
        [rng.randrange(3, 2048) for _ in range(geo.prompt_tokens)]
        for _ in range(geo.num_prompts)
    ]
    (work / "prompts.json").write_text(json.dumps(geo.prompts))
    geo.decode_prompts = [
        [rng.randrange(3, 2048) for _ in range(256)] for _ in range(4)
    ]
    (work / "decode.json").write_text(json.dumps(geo.decode_prompts))
    twice = [p for p in geo.prompts for _ in "ab"]
    (work / "twice.json").write_text(json.dumps(twice))
    return geo


# -- cold ---------------------------------------------------------------------------

DROP_CACHES = "/proc/sys/vm/drop_caches"
DROP_METHOD = "drop_caches" if os.access(DROP_CACHES, os.W_OK) else "fadvise"

#: Seconds between a storing process and the cold read that follows it.
SETTLE_S = 15.0


def settle_after_writes() -> None:
    """Sync, then wait SETTLE_S seconds: the cold case is a restart, long after
    the KV was written. On host vm's virtual disk (docs/RESULTS.md) a read
    right after a store competes with the hypervisor still writing that data
    back: the same 2,000-token
    cold hit took 114-139 ms in start_load_kv right after storing and 45-57 ms
    on a second cold run (42-57 ms after a 15 s pause). Both connectors get the
    same pause."""
    os.sync()
    time.sleep(SETTLE_S)


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache (the whole cache when this
    process may write drop_caches): the next process reads them from disk."""
    os.sync()
    if DROP_METHOD == "drop_caches":
        with open(DROP_CACHES, "w", encoding="ascii") as handle:
            handle.write("3\n")
        return
    for file in (p for p in path.rglob("*") if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_cold_read(path: Path) -> tuple[float, int]:
    """Seconds and bytes to read every file under ``path`` once, sequentially
    in 4 MiB ``readinto`` calls, page cache dropped before: the disk's speed for
    these bytes at this moment (host vm's disk drifts by 2x over minutes, so
    the bound is measured next to the cold hits, not taken from bench io).
    The files are listed before the clock starts (their inodes then cached):
    the bound is the data's time, no metadata."""
    files = sorted(p for p in path.rglob("*.safetensors") if p.is_file())
    buffer = bytearray(4 << 20)
    total = 0
    started = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                total += got
    return time.perf_counter() - started, total


# -- the connector's own cost of an idle step ---------------------------------------


def idle_step_us(steps: int = 5000) -> float:
    """Microseconds the connector adds to a step with nothing to load or save:
    both halves driven directly (no vLLM engine, so no noise from it) through
    one decode step of 4 running requests over 8 layers: build_meta, bind, the
    two layer hooks per layer, wait_for_save, get_finished, stats."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from npukv_store import StoreConfig
    from npukv_store.connector.metadata import NPUKVMetadata
    from npukv_store.connector.scheduler.side import SchedulerSide
    from npukv_store.connector.worker.side import WorkerSide

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(8)]
    blocks, shape = 64, (8, 32, 128)  # heads, block tokens, K|V dims (fp32)
    page = 4 * shape[0] * shape[1] * shape[2]
    spec = FullAttentionSpec(
        block_size=shape[1], num_kv_heads=shape[0], head_size=shape[2] // 2,
        dtype=torch.float32,
    )  # fmt: skip
    assert spec.page_size_bytes == page
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=layers, kv_cache_spec=spec)],
        kv_cache_layout="LBHNC",
        num_blocks=blocks,
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=1
        ),
        model_config=SimpleNamespace(model="idle-bench", revision=None, use_mla=False),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
    )
    with tempfile.TemporaryDirectory() as tmp:
        settings = StoreConfig(cache_dir=tmp, ring_size="16MiB")
        scheduler = SchedulerSide(vllm_config, kv_cache_config, settings)
        worker = WorkerSide(vllm_config, kv_cache_config, settings)
        worker.register({n: torch.zeros(blocks, *shape) for n in layers})
        requests = {}
        for i in range(4):  # running requests whose prompt blocks are saved
            tokens = list(range(i * 1000, i * 1000 + 256))
            request = SimpleNamespace(
                request_id=f"r{i}", all_token_ids=tokens, prompt_token_ids=tokens,
                num_tokens=256, num_prompt_tokens=256, num_computed_tokens=300,
                lora_request=None, mm_features=[], cache_salt=None,
                prompt_embeds=None,
            )  # fmt: skip
            scheduler.match(request, 0)
            scheduler.allocated(request, ([],), 0)
            scheduler._requests[request.request_id].saved_blocks = 8
            requests[request.request_id] = request
        output = SimpleNamespace(num_scheduled_tokens={r: 1 for r in requests})
        started = time.perf_counter()
        for _ in range(steps):
            meta = scheduler.build_meta(output)
            worker.bind(meta)
            for name in layers:
                worker.wait_layer(name)
                worker.save_layer(name)
            worker.finish_step()
            worker.finished_sending()
            worker.take_load_errors()
            worker.take_stats()
            scheduler.take_stats()
        elapsed = time.perf_counter() - started
        assert isinstance(meta, NPUKVMetadata)
        assert meta.is_empty()
        worker.close()
        scheduler.close()
    return elapsed / steps * 1e6
