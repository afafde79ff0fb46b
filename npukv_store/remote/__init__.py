"""The tier behind the local store: Mooncake Store, shared by several nodes.

    value.py    the bytes of one block in the tier (self-describing, verified)
    breaker.py  the circuit breaker that stops asking a dead master
    tier.py     MooncakeTier: the client, its threads, lookups, puts, loads

Imports only config, spec and errors of this package (and numpy, xxhash,
mooncake); the connector wires it in (docs/decisions/0055).
"""

from npukv_store.remote.tier import MooncakeTier, open_tier, release_tier
from npukv_store.remote.value import ValueLayout, remote_key

__all__ = ["MooncakeTier", "ValueLayout", "open_tier", "release_tier", "remote_key"]
