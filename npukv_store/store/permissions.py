"""Who may touch a cache directory: the modes it is created with and the
owner and mode checks made when it is opened.

Runs in: any process opening a store, the maintenance job and the CLI.

    Access.for_config()  - private (0700/0600) or one group's (2770/0660)
    Access.dir_mode      - mode of every directory the store creates
    Access.file_mode     - mode of every file the store creates
    Access.check_root()  - refuse a root others may write, or one owned by
                           someone else (docs/security.md)
    Access.of_root()     - the access an existing root was made with (tools)
    Access.owns()        - whether an entry inside the cache is ours
    Access.fix_mode()    - the mode a fresh entry was meant to get, whatever
                           the umask took away
    check_tool_root()    - a tool run as root refuses a root it does not own
    act_as_owner()       - ``--as-owner``: root becomes the root's owner

A private cache is the default: a chunk file gives its prompt away (layer 0's
KV at position i depends only on token i and the public weights), so no mode
the store creates ever has a world bit.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass

from npukv_store.errors import ConfigError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
GROUP_DIR_MODE = 0o2770  # setgid: what is created inside keeps the group
GROUP_FILE_MODE = 0o660


@dataclass(frozen=True, slots=True)
class Access:
    """How one cache directory is shared: by its owner alone (``gid`` None)
    or with one group."""

    gid: int | None = None

    @classmethod
    def for_config(cls, cache_group: str) -> Access:
        """The access a ``cache_group`` setting asks for.

        Raises:
            ConfigError: the group does not exist.
        """
        if not cache_group:
            return cls(None)
        if cache_group.isdigit():
            return cls(int(cache_group))
        try:
            return cls(grp.getgrnam(cache_group).gr_gid)
        except KeyError:
            raise ConfigError(
                f"cache_group: found {cache_group!r}, expected an existing group "
                "name or a gid"
            ) from None

    @classmethod
    def of_root(cls, st: os.stat_result) -> Access:
        """The access an existing root says it was made with: group mode when
        it is setgid and its group may do everything (2770), else private.

        For the tools (maintenance, ``npukv``), which have no config: what
        they create must be usable by the servers that share the directory.
        Only the root's owner can set its mode, so nobody else chooses this.
        """
        group_mode = st.st_mode & stat.S_ISGID and (
            st.st_mode & stat.S_IRWXG == stat.S_IRWXG
        )
        return cls(st.st_gid if group_mode else None)

    @property
    def dir_mode(self) -> int:
        return PRIVATE_DIR_MODE if self.gid is None else GROUP_DIR_MODE

    @property
    def file_mode(self) -> int:
        return PRIVATE_FILE_MODE if self.gid is None else GROUP_FILE_MODE

    def owns(self, st: os.stat_result, euid: int | None = None) -> bool:
        """Whether an entry inside the cache belongs to it: ours, or (group
        mode) the group's. Another user's entry may be a trap (a symlink
        swapped in, a file whose writes land elsewhere): never used."""
        euid = os.geteuid() if euid is None else euid
        return st.st_uid == euid or (self.gid is not None and st.st_gid == self.gid)

    def fix_mode(self, fd: int, mode: int) -> None:
        """Give a fresh file or directory ``mode`` whatever the umask did.

        Private modes (0700/0600) survive any umask that leaves the owner
        its own bits, so this only acts in group mode, where a umask of 022
        takes the group's write bit away (2750/0640): the directory must
        then be handed to the group too (``fchown``) when the process's
        primary group is another one; setgid directories give their group
        to what is created inside them anyway.
        """
        if self.gid is None:
            return
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return  # another member made it, and gave it its mode
        if st.st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)

    def check_root(
        self, root: str, st: os.stat_result, euid: int | None = None
    ) -> None:
        """Refuse a cache root that others could use to read or redirect it.

        Raises:
            ConfigError: the root is not a directory, is writable by every
                user, is owned by another user (private mode), or, in group
                mode, belongs neither to us nor to the group.
        """
        euid = os.geteuid() if euid is None else euid
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"cache_dir: {root} is not a directory")
        if st.st_mode & stat.S_IWOTH:
            raise ConfigError(
                f"cache_dir: {root} is writable by every user (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); expected 0700, or 2770 with "
                "cache_group"
            )
        if st.st_uid == euid:
            return
        if self.gid is not None and st.st_gid == self.gid:
            return
        raise ConfigError(
            f"cache_dir: {root} is owned by uid {st.st_uid}, expected uid {euid}"
            + ("" if self.gid is None else f" or group {self.gid} (cache_group)")
            + "; as root, act as the owner (npukv --as-owner) or pick another "
            "directory"
        )


def check_tool_root(root: str, st: os.stat_result) -> None:
    """Refuse, in a tool run as root (the maintenance job, ``npukv``), a root
    that root does not own: whoever owns it could have planted links there
    for root to follow (docs/security.md), and files root creates there
    would be root's, unusable by the servers. Group mode does not make root
    a member: it acts as the owner (``--as-owner``) instead.

    Raises:
        ConfigError: naming the owner and the flag.
    """
    if os.geteuid() == 0 and st.st_uid != 0:
        raise ConfigError(
            f"cache_dir: {root} is owned by uid {st.st_uid} and this runs as "
            f"root; expected a directory root owns, or --as-owner to act as uid "
            f"{st.st_uid}"
        )


def act_as_owner(root: str) -> None:
    """``--as-owner``: drop from root to the uid and gid that own ``root``,
    before anything in it is touched. Nothing to do when we own it already.

    Raises:
        ConfigError: ``root`` is missing or not a directory, or it is
            someone else's and we are not root (only root can switch).
    """
    try:
        st = os.stat(root, follow_symlinks=False)
    except OSError as exc:
        raise ConfigError(f"--as-owner: {root}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"--as-owner: {root} is not a directory")
    if st.st_uid == os.geteuid():
        return
    if os.geteuid() != 0:
        raise ConfigError(
            f"--as-owner: {root} is owned by uid {st.st_uid}, and only root can "
            f"act as another user (this runs as uid {os.geteuid()})"
        )
    # Supplementary groups first (they need root), then the gid, the uid
    # last: once the uid changes, nothing else can.
    try:
        os.initgroups(pwd.getpwuid(st.st_uid).pw_name, st.st_gid)
    except KeyError:  # a uid without a passwd entry: no other groups
        os.setgroups([])
    os.setgid(st.st_gid)
    os.setuid(st.st_uid)
