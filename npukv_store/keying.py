"""The secrets behind block keys, remote key names and remote MACs.

Runs in: any process; reads one or two secret files, then pure functions.

Two secrets, one per trust domain (docs/format.md "Keys and secrets"):

    cache secret   <cache_dir>/secret, 32 random bytes made with the
                   directory (0600, or 0660 with cache_group), kept across
                   restarts; an operator copies it to share a cache
    remote secret  remote_secret_file, shared by every node of one remote
                   tier (at least 32 bytes, not readable by other users)

Each secret is stretched into independent keys by keyed BLAKE2b with a
distinct personalisation per purpose, so knowing one derived key tells
nothing about another:

    chain key      keys the block chain (npukv_store.hashing): the remote
                   secret's when a remote tier is configured, so that every
                   node of the tier derives the same chain; the cache
                   secret's otherwise
    name key       remote key name = BLAKE2b(name key, namespace || chain key)
    MAC key        remote value MAC = BLAKE2b(MAC key, header || checksums)
    tenant key     a tenant's name = BLAKE2b-64(tenant key, cache salt), from
                   the cache secret (tenants are the directory's own)
    pin key        a pinned prompt's digests (npukv_store.store.pins), from
                   the cache secret: what ``npukv pin`` and servers compare

Local keys are the chain itself; remote names are a PRF of it under another
key, so the names the Mooncake master lists reveal neither the chain nor the
prompt, and nobody without the secret can compute either.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

from npukv_store.errors import ConfigError

SECRET_BYTES = 32
CACHE_SECRET_FILE = "secret"
TENANT_BYTES = 8
#: the tenant of requests without a cache salt (and of chunks written before
#: tenants: their headers name none)
DEFAULT_TENANT = bytes(TENANT_BYTES)


def derive(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for ``purpose`` (at most 16 bytes) from ``secret``."""
    return hashlib.blake2b(
        b"npukv-store-key", key=secret[:64], person=purpose, digest_size=32
    ).digest()


def read_secret_file(
    path: str, *, what: str, dir_fd: int | None = None, gid: int | None = None
) -> bytes:
    """The bytes of a secret file, checked: a regular file of ours (or, with
    ``gid``, of that group: a cache shared through ``cache_group``), not a
    symlink, unreadable by other users, at least :data:`SECRET_BYTES` long.

    Raises:
        ConfigError: naming ``what`` (the config key or file), what was found
            and what was expected.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ConfigError(
            f"{what}: {path} does not exist; expected a secret file"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{what}: cannot open {path} ({exc.strerror}); expected a regular "
            "secret file, not a symlink"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {path} is not a regular file")
        if st.st_mode & stat.S_IRWXO:
            raise ConfigError(
                f"{what}: {path} has mode {stat.S_IMODE(st.st_mode):04o}; expected "
                "no access for other users (chmod 600)"
            )
        ours = st.st_uid in (os.geteuid(), 0)
        if not ours and not (gid is not None and st.st_gid == gid):
            raise ConfigError(
                f"{what}: {path} is owned by uid {st.st_uid}, expected uid "
                f"{os.geteuid()}"
            )
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(data) < SECRET_BYTES:
        raise ConfigError(
            f"{what}: {path} holds {len(data)} bytes, expected at least "
            f"{SECRET_BYTES} random bytes (e.g. head -c 32 /dev/urandom)"
        )
    return data


def tenant_digest(tenant_key: bytes, cache_salt: str | None) -> bytes:
    """The 8-byte name of the tenant of ``cache_salt`` (docs/decisions/0067):
    files and metrics carry it, never the salt, and nobody without the cache
    secret can tell which salt it names. No salt (or ""): the default tenant,
    as vLLM's prefix cache treats an empty salt as none."""
    if not cache_salt:
        return DEFAULT_TENANT
    digest = hashlib.blake2b(
        cache_salt.encode(), key=tenant_key, digest_size=TENANT_BYTES
    ).digest()
    return digest if digest != DEFAULT_TENANT else b"\xff" * TENANT_BYTES


@dataclass(frozen=True, slots=True)
class RemoteKeys:
    """What the remote tier keys with: its key names and its values' MACs.
    ``insecure``: derived from a public constant (``remote_insecure``), so
    anyone can compute both."""

    name_key: bytes
    mac_key: bytes
    insecure: bool = False

    @classmethod
    def from_secret(cls, secret: bytes, *, insecure: bool = False) -> RemoteKeys:
        return cls(
            derive(secret, b"remote-name"), derive(secret, b"remote-mac"), insecure
        )


# remote_insecure: every node derives the same "secret", so anyone can
INSECURE_REMOTE_SECRET = b"npukv-store: remote_insecure=true".ljust(SECRET_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class KeyDomain:
    """The keys one process derives its block keys and remote names with.
    ``remote`` is None without a remote tier, or where the tier may not run
    (no ``remote_secret_file`` and not ``remote_insecure``)."""

    chain_key: bytes
    remote: RemoteKeys | None = None
    tenant_key: bytes = b""  # from the cache secret, whatever the chain's domain
    pin_key: bytes = b""

    @classmethod
    def for_config(
        cls,
        cache_secret: bytes,
        *,
        remote_store: str = "none",
        remote_secret_file: str = "",
        remote_insecure: bool = False,
    ) -> KeyDomain:
        """The remote tier's domain where one is configured and may run (every
        node of the tier derives the same chain), else the cache's own.

        Raises:
            ConfigError: ``remote_secret_file`` is named but unusable.
        """
        tenant_key = derive(cache_secret, b"tenant")
        pin_key = derive(cache_secret, b"pin")
        if remote_store != "none" and remote_secret_file:
            shared = read_secret_file(remote_secret_file, what="remote_secret_file")
            insecure = False
        elif remote_store != "none" and remote_insecure:
            shared, insecure = INSECURE_REMOTE_SECRET, True
        else:
            return cls(derive(cache_secret, b"chain"), None, tenant_key, pin_key)
        return cls(
            derive(shared, b"chain"),
            RemoteKeys.from_secret(shared, insecure=insecure),
            tenant_key,
            pin_key,
        )

    def tenant(self, cache_salt: str | None) -> bytes:
        """The tenant of ``cache_salt`` (:func:`tenant_digest`)."""
        return tenant_digest(self.tenant_key, cache_salt)


def remote_keys_for(
    remote_store: str, remote_secret_file: str, remote_insecure: bool
) -> RemoteKeys | None:
    """The remote tier's keys, or None where the tier may not run: no
    secret file and not ``remote_insecure``.

    Raises:
        ConfigError: ``remote_secret_file`` is named but unusable.
    """
    if remote_store == "none":
        return None
    domain = KeyDomain.for_config(
        b"\0" * SECRET_BYTES,  # the cache secret plays no part in the tier's keys
        remote_store=remote_store,
        remote_secret_file=remote_secret_file,
        remote_insecure=remote_insecure,
    )
    return domain.remote
