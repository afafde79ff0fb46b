"""The npukv_store exception hierarchy.

Expected outcomes (a miss, no room in the ring) are return values, never exceptions.
These classes are for bad external input (config, files, headers, the wrong model)
and for I/O failures. Every message names what was found and what was expected.

    NpuKVError
      ConfigError          a StoreConfig key or value is wrong
      UnsupportedSetup     vLLM runs a setup the connector does not serve
      FormatError          a file on disk is not what the format says
        BadMagic           not an npukv file at all
        VersionMismatch    an npukv file of another format version
        NamespaceMismatch  a chunk or directory of another namespace (model/layout)
        CorruptChunk       a chunk whose structure or checksums are wrong
      IOEngineError        an I/O call failed; also an OSError carrying errno
"""

from __future__ import annotations


class NpuKVError(Exception):
    """Base class of every error raised on purpose by npukv_store."""


class ConfigError(NpuKVError, ValueError):
    """A configuration key is unknown or its value is out of range or garbled."""


class UnsupportedSetup(NpuKVError):
    """vLLM runs a setup the connector cannot serve correctly (pipeline
    parallelism, a KV cache group with no block-wise hit, such as Mamba or
    linear attention). The connector turns itself off with one error line
    naming what it found; vLLM serves on without it."""


class FormatError(NpuKVError):
    """A file in the cache directory does not follow the on-disk format.

    The message names the file and the first problem found. Readers treat every
    file as untrusted input, so this is raised instead of returning doubtful data.
    """


class BadMagic(FormatError):
    """The file does not start like an npukv file (marker or chunk)."""


class VersionMismatch(FormatError):
    """The file is an npukv file, but of a format version this code cannot read."""


class NamespaceMismatch(FormatError):
    """The file belongs to another namespace (another model, layout or TP rank)."""


class CorruptChunk(FormatError):
    """A chunk's header, sizes or checksums are inconsistent."""


class IOEngineError(NpuKVError, OSError):
    """An I/O request failed; ``errno`` carries the kernel's error number."""
