"""npukv_store: a crash-safe local NVMe KV-cache tier for vLLM.

Public API (the store layer imports neither torch nor vllm):

    StoreConfig                       every knob, parsed from vLLM's extra config
    NamespaceSpec, LayerSpec, PartSpec  what makes KV bytes compatible
    KVStore                           put / lookup / read / stats / check / close
    chain_hashes, namespace_fingerprint  block keys
"""

from npukv_store.config import StoreConfig, parse_size
from npukv_store.errors import (
    BadMagic,
    ConfigError,
    CorruptChunk,
    FormatError,
    IOEngineError,
    NamespaceMismatch,
    NpuKVError,
    UnsupportedSetup,
    VersionMismatch,
)
from npukv_store.hashing import chain_hashes, namespace_fingerprint
from npukv_store.spec import FORMAT_VERSION, LayerSpec, NamespaceSpec, PartSpec
from npukv_store.store import KVStore, PutResult, StoreStats

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "BadMagic",
    "ConfigError",
    "CorruptChunk",
    "FormatError",
    "IOEngineError",
    "KVStore",
    "LayerSpec",
    "NamespaceMismatch",
    "NamespaceSpec",
    "NpuKVError",
    "PartSpec",
    "PutResult",
    "StoreConfig",
    "StoreStats",
    "UnsupportedSetup",
    "VersionMismatch",
    "chain_hashes",
    "namespace_fingerprint",
    "parse_size",
]
