"""The tier behind the local store: Mooncake Store, shared by several nodes.

    value.py    the bytes of one block in the tier (self-describing, MACed) and
                its key name (keyed: the names reveal no namespace nor key)
    breaker.py  the circuit breaker that stops asking a dead master
    client.py   return codes, counters, the tier's keys, making a client
    tier.py     MooncakeTier: the client's state, threads, breaker, lookups
    transfers.py  its puts (from the ring) and loads (verified)

Imports only config, spec, errors, keying and native of this package (and
numpy, xxhash, mooncake); the connector wires it in (docs/decisions/0055).
"""

from npukv_store.remote.tier import MooncakeTier, open_tier, release_tier
from npukv_store.remote.value import ValueLayout, remote_key

__all__ = ["MooncakeTier", "ValueLayout", "open_tier", "release_tier", "remote_key"]
