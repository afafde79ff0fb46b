"""Running real vLLM for the end-to-end tests: one process per run, through
``python -m bench.harness.vllm_run``, its log kept next to its report.

Most runs use VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in the harness
process, about 10-20 s a run), which also lets the harness count the tokens the
connector claims per prompt (``external_tokens``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.harness.processes import child_env, python_module, reap, reaping

# WARMUP_TOKENS: the unrelated prompt every run sends first, the same in every
# run, so a connector run loads its blocks too
from bench.harness.vllm_run import MODULE, WARMUP_TOKENS

__all__ = [
    "WARMUP_TOKENS", "build_model", "finish", "reap", "reaping", "run", "start", "wait",
]  # fmt: skip


def build_model(path: Path, family: str = "", args: tuple[str, ...] = ()) -> Path:
    """A tiny random-weight model (``family`` from bench/harness/tiny_models.py,
    or the harness's own Llama); ``args``: more build-model options (``--seed
    1``, a shape); returns ``path``."""
    cmd = python_module(MODULE, "build-model", str(path), *args)
    if family:
        cmd += ["--family", family]
    subprocess.run(cmd, check=True, capture_output=True, env=child_env())
    return path


def start(
    work: Path,
    name: str,
    prompts: list[list[int]],
    *,
    model: Path,
    cache_dir: Path | None = None,
    extra: dict[str, Any] | None = None,
    args: tuple[str, ...] = (),
    multiprocess: bool = False,
    max_tokens: int = 8,
    connector: str = "npukv",
) -> subprocess.Popen[bytes]:
    """Start one vLLM process over ``prompts`` (greedy), with ``connector``
    (the harness's name) where ``cache_dir`` is given; see :func:`finish`."""
    prompt_file = work / f"{name}.prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    cmd = python_module(
        MODULE, "run", "--model", str(model),
        "--prompts", str(prompt_file), "--out", str(work / f"{name}.json"),
        "--max-tokens", str(max_tokens), *args,
    )  # fmt: skip
    if cache_dir is not None:
        config = {
            "cache_dir": str(cache_dir),
            "capacity": "1GiB",
            "ring_size": "64MiB",
            **(extra or {}),
        }
        cmd += ["--connector", connector, "--extra", json.dumps(config)]
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
    with open(work / f"{name}.log", "wb") as log:  # the child keeps its own fd
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait(proc: subprocess.Popen[bytes], timeout_s: float = 600) -> int:
    """``proc``'s exit code; whatever stops the wait (its timeout, the test's
    timeout, an interrupt) kills and reaps ``proc`` before it propagates."""
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:
        reap(proc)
        raise


def finish(work: Path, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Wait for a run (see :func:`wait`); its report, with its log under
    ``"log"``."""
    rc = wait(proc)
    log = (work / f"{name}.log").read_text(errors="replace")
    assert rc == 0, f"vLLM run {name} failed (rc {rc}):\n{log[-6000:]}"
    report: dict[str, Any] = json.loads((work / f"{name}.json").read_text())
    report["log"] = log
    return report


def run(work: Path, name: str, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
    """:func:`start` and :func:`finish` one run."""
    return finish(work, name, start(work, name, prompts, **kw))


def corrupt_copy(source: Path, dest: Path) -> list[Path]:
    """A copy of cache directory ``source`` at ``dest`` with bytes flipped all
    over the data section of every chunk; returns the chunk files."""
    import shutil

    shutil.copytree(source, dest)
    chunks = list(dest.glob("*/chunks/*.safetensors"))
    for path in chunks:
        data = bytearray(path.read_bytes())
        for offset in range(8192, len(data) - 4096, 4099):
            data[offset] ^= 0x5A
        path.write_bytes(bytes(data))
    return chunks


def tokens(report: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in report["results"]]


def external(report: dict[str, Any]) -> list[int]:
    return [r["external_tokens"] for r in report["results"]]


def cached(report: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in report["results"]]
