"""A load policy that has already measured loads and steps, on a fake clock."""

from __future__ import annotations

from npukv_store.connector.scheduler.load_policy import LoadPolicy

BLOCK_BYTES = 1 << 20
BLOCK_TOKENS = 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def measured_policy(
    load_fixed: float,
    per_byte: float,
    per_token: float,
    *,
    mode: str = "auto",
    clock: Clock | None = None,
) -> LoadPolicy:
    """A policy that has seen loads of 1..8 blocks and steps of 16..1024 tokens
    costing exactly that much (page cache only)."""
    policy = LoadPolicy(mode, margin=0.25, clock=clock or Clock())
    policy.observe_loads(
        (load_fixed + n * BLOCK_BYTES * per_byte, n * BLOCK_BYTES, 0)
        for n in range(1, 9)
    )
    policy.observe_steps((0.002 + t * per_token, t) for t in (16, 64, 256, 1024) * 3)
    return policy
