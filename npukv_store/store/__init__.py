"""The on-disk block store: chunk files (format.py), the shared index (index.py)
and the KVStore facade (store.py)."""

from npukv_store.store.stats import PutResult, StoreStats
from npukv_store.store.store import KVStore

__all__ = ["KVStore", "PutResult", "StoreStats"]
