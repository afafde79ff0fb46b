"""Tenants of a cache directory: the capacity each cache salt is given.

Runs in: any process with a store handle; pure functions.

    share_bytes() - config.tenant_shares as bytes per tenant digest

A tenant is the keyed digest of a request's cache salt
(npukv_store.keying.tenant_digest); requests without one are the default
tenant. The index keeps each tenant's bytes in its ledger, and eviction
takes from the tenants over their share first (store.policy.pick_victims,
docs/decisions/0067).
"""

from __future__ import annotations

from collections.abc import Callable

from npukv_store.config import StoreConfig


def share_bytes(
    config: StoreConfig, tenant_of: Callable[[str | None], bytes]
) -> dict[bytes, int]:
    """Each configured tenant's share in bytes: a fraction of ``capacity``,
    or a byte count as it is."""
    shares: dict[bytes, int] = {}
    for salt, share in config.tenant_shares:
        size = int(share * config.capacity) if isinstance(share, float) else share
        tenant = tenant_of(salt)
        shares[tenant] = shares.get(tenant, 0) + size
    return shares
