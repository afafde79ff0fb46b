"""Checks shared by the served tests (tests/e2e/test_serve*.py): a request's
output is compared with the reference server's tokens for the same prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Reference", "check_outputs"]

#: the reference server's output tokens for each prompt (as a tuple)
Reference = Mapping[tuple[int, ...], list[int]]


def check_outputs(
    what: str,
    results: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    reference: Reference,
) -> None:
    """Every request the client did not cancel finished with the reference
    server's tokens for its prompt; ``results`` are bench.harness.serve Results, in
    the order of ``prompts``. The assertion names each request that differs
    (the first eight)."""
    bad = []
    for result, prompt in zip(results, prompts, strict=True):
        if result.cancelled:
            continue
        expected = reference[tuple(prompt)]
        if result.error is not None:
            bad.append(f"request {result.index}: error {result.error}")
        elif result.tokens != expected:
            bad.append(
                f"request {result.index} ({len(prompt)} prompt tokens): found "
                f"{result.tokens}, expected {expected}"
            )
    assert not bad, (
        f"{what}: {len(bad)} of {len(results)} outputs differ from the reference "
        "server's:\n" + "\n".join(bad[:8])
    )
