"""The vLLM demo: one process computes a long prompt and saves its KV through
NPUKVStoreConnector; a second process, started afterwards, loads it instead of
recomputing it.

A random-weight Llama (8 layers, hidden 512, 8 heads of 64, fp32) is built
locally, nothing is downloaded. Process 1 runs prompt A (about 2,000 tokens).
Process 2 runs a fresh prompt B of the same length (recompute) and then A (a
hit from the store), timing each to its first token, and checks that A's greedy
tokens equal process 1's. Then it prints the directory's stats, as
``npukv stats`` does.

Usage: python scripts/demo_vllm.py [--dir PATH] [--prompt-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the vLLM harness, run as ``python -m HARNESS`` with ROOT on PYTHONPATH
HARNESS = "bench.harness.vllm_run"


def harness_env(**overrides: str) -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH (the
    harness is the ``bench`` package's, beside this script's folder)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **overrides)


def run_vllm(work: Path, name: str, prompts: list[list[int]], cache: Path) -> Any:
    (work / f"{name}.prompts.json").write_text(json.dumps(prompts))
    config = {"cache_dir": str(cache), "capacity": "4GiB", "ring_size": "512MiB"}
    cmd = [
        sys.executable, "-m", HARNESS, "run", "--model", str(work / "model"),
        "--prompts", str(work / f"{name}.prompts.json"),
        "--out", str(work / f"{name}.json"), "--max-tokens", "16", "--ttft",
        "--max-model-len", "4096", "--connector", "npukv",
        "--extra", json.dumps(config),
    ]  # fmt: skip
    env = harness_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    print(f"[{name}] starting vLLM (log: {work / (name + '.log')})", flush=True)
    with open(work / f"{name}.log", "wb") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env
        ).returncode
    if rc != 0:
        print((work / f"{name}.log").read_text(errors="replace")[-4000:])
        raise SystemExit(f"[{name}] vLLM failed with exit code {rc}")
    return json.loads((work / f"{name}.json").read_text())["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="npukv_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    print("building a random-weight Llama (8 layers, hidden 512, fp32) ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", HARNESS, "build-model", str(work / "model"),
         "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "8"],
        check=True, capture_output=True, env=harness_env(),
    )  # fmt: skip
    rng = random.Random(2026)
    prompt_a = [rng.randrange(3, 2048) for _ in range(args.prompt_tokens)]
    prompt_b = [rng.randrange(3, 2048) for _ in range(args.prompt_tokens)]

    (first,) = run_vllm(work, "process-1", [prompt_a], cache)
    fresh, hit = run_vllm(work, "process-2", [prompt_b, prompt_a], cache)

    stats = json.loads(
        subprocess.run(
            [sys.executable, "-m", "npukv_store.cli", "stats", str(cache), "--json"],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    same = hit["tokens"] == first["tokens"]
    print()
    print(f"prompt A: {len(prompt_a)} tokens; process 1 computed and saved it")
    # claimed by the connector; vLLM's own prefix cache (on, as in production)
    # serves the repeat of A inside process 2
    print(f"process 2 loaded {hit['external_tokens']} tokens of A from the store")
    print(f"TTFT recompute (prompt B, process 2): {fresh['ttft_s'] * 1e3:8.1f} ms")
    print(f"TTFT hit       (prompt A, process 2): {hit['ttft_s'] * 1e3:8.1f} ms")
    print(f"speed-up: {fresh['ttft_s'] / hit['ttft_s']:.2f}x")
    print(f"greedy tokens of A identical across processes: {same}")
    print(f"bytes on disk: {stats['used_bytes']:,} in {stats['chunks']} chunks")
    print("store stats (npukv stats):", flush=True)
    subprocess.run([sys.executable, "-m", "npukv_store.cli", "stats", str(cache)])
    # The maintenance job on the directory vLLM left: verify every block, merge.
    print("maintenance (scripts/compact.py --verify):", flush=True)
    compact = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compact.py")), str(cache),
         "--verify"],
    )  # fmt: skip
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same and compact.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
