"""What every scenario checks, and the put it makes: the scenarios'
namespace, one put in either mode, reads checked byte for byte, and the
whole-directory check after a run or a kill."""

from __future__ import annotations

from collections.abc import Sequence

from npukv_store import KVStore, PutResult
from tests.support.blocks import empty_blocks, tiny_spec, verify_read

#: The scenarios' namespace (and the fault suite's small one): 4-token blocks,
#: so a prompt of a few dozen tokens is many blocks.
SPEC = tiny_spec(block_size=4)


def do_put(store: KVStore, keys: list[bytes], tensors, mode: str):
    """One put the way ``mode`` says: "sync" is ``put``; "async" is
    ``put_async`` + ``flush`` (the async path's durability point), with the
    outcome read from the counters the writer thread updated."""
    if mode == "sync":
        return store.put(keys, tensors)
    before = store.counters.snapshot()
    staged = store.put_async(keys, tensors)
    if not store.flush(timeout_s=60):
        raise RuntimeError("flush() did not finish in 60 s")
    after = store.counters.snapshot()
    if staged.dropped or after["failed_batches"] != before["failed_batches"]:
        raise RuntimeError(f"async put lost its batch: {staged}, {after}")
    return PutResult(
        stored=after["put_blocks"] - before["put_blocks"],
        skipped=after["skipped_blocks"] - before["skipped_blocks"],
        rejected=after["rejected_blocks"] - before["rejected_blocks"],
    )


def indexed_keys(store: KVStore) -> list[bytes]:
    """Every key the shared index holds (one snapshot)."""
    return [key for key, _, _ in store.index.iter_keys()]


def read_and_verify(
    store: KVStore, keys: Sequence[bytes], *, expect_all: bool
) -> list[str]:
    """Read ``keys`` (in batches); problems: wrong bytes, or misses if
    ``expect_all``."""
    problems = []
    for start in range(0, len(keys), 256):
        batch = list(keys[start : start + 256])
        out = empty_blocks(store.spec, len(batch))
        ok = store.read(batch, out)
        problems += verify_read(store.spec, batch, out, ok)
        if expect_all:
            problems += [
                f"key {k.hex()} should be readable but read() missed it"
                for k, hit in zip(batch, ok, strict=True)
                if not hit
            ]
    return problems


def verify_store(store: KVStore) -> list[str]:
    """check() with data, then every indexed key must read back correctly.

    Call on a quiescent directory: nobody else may evict meanwhile.
    """
    problems = [f"check: {p}" for p in store.check(verify_data=True)]
    problems += read_and_verify(store, indexed_keys(store), expect_all=True)
    return problems


def fail(what: str, problems: Sequence[str], limit: int = 20) -> None:
    """Raise one AssertionError listing ``problems`` (the first ``limit``), if any."""
    if problems:
        shown = "\n  ".join(problems[:limit])
        more = (
            f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        )
        raise AssertionError(f"{what}: {len(problems)} problem(s):\n  {shown}{more}")
