"""A FUSE passthrough file system that records every operation that changes
what a disk would hold, for the power-loss harness (tests/power, issue 40).

Run as ``python -m tests.power.recordfs BACKING MOUNTPOINT LOG``: it mounts
BACKING at MOUNTPOINT (in the foreground, one thread, so operations are
recorded in the order the kernel hands them over) and, at unmount, writes the
log to LOG (pickle: a list of tuples). A file or directory is named in the log
by an id given when it is created (never the backing inode number, which the
backing file system reuses); the mount's root is id 0. The records:

    ("create", parent, name, id, mode)     a new file (create, mknod)
    ("mkdir", parent, name, id, mode)
    ("write", id, offset, data)
    ("trunc", id, size)                    truncate / ftruncate
    ("falloc", id, offset, length)         fallocate mode 0 (size grows)
    ("chmod", id, mode)
    ("link", id, parent, name)
    ("unlink", parent, name, id)           unlink, rmdir
    ("rename", src_parent, src_name, dst_parent, dst_name, id)
    ("fsync", id)                          fsync, fdatasync, fsync on a dir
    ("mark", label)                        a stat of ``/.power-mark-<label>``:
                                           the workload's "this commit returned"

The mark is how a workload says, in order with its own operations, that a
commit returned: it stats a name that does not exist and gets ENOENT.

Why not LD_PRELOAD or strace: LMDB's own writes (pwrite, fdatasync) and the
kernel's writeback of shared mappings only show up below the VFS. LMDB opened
without ``writemap`` (npukv_store/store/envs.py) writes its pages with pwrite,
so every one of them reaches this file system; lock.mdb is a shared mapping
whose stores arrive as writeback, whenever the kernel chooses (its content is
rebuilt by LMDB at the first open after a crash, so it does not matter).
"""

from __future__ import annotations

import errno
import os
import pickle
import stat
import sys

import mfusepy as fuse

MARK_PREFIX = ".power-mark-"


class RecordFS(fuse.Operations):
    use_ns = True

    def __init__(self, backing: str, log_path: str) -> None:
        self.backing = os.path.realpath(backing)
        self.log_path = log_path
        self.log: list[tuple] = []
        self.next_id = 1
        self.ids: dict[int, int] = {os.lstat(self.backing).st_ino: 0}

    # -- helpers -------------------------------------------------------------

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _id(self, full: str) -> int:
        ino = os.lstat(full).st_ino
        found = self.ids.get(ino)
        if found is None:  # made outside the mount: not expected
            found = self.ids[ino] = self._new_id()
        return found

    def _fid(self, fh: int) -> int:
        ino = os.fstat(fh).st_ino
        found = self.ids.get(ino)
        if found is None:
            found = self.ids[ino] = self._new_id()
        return found

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _split(self, path: str) -> tuple[int, str]:
        parent, name = os.path.split(path.rstrip("/"))
        return self._id(self._full(parent or "/")), name

    # -- metadata ------------------------------------------------------------

    def getattr(self, path, fh=None):
        name = os.path.basename(path)
        if name.startswith(MARK_PREFIX):
            self.log.append(("mark", name[len(MARK_PREFIX) :]))
            raise fuse.FuseOSError(errno.ENOENT)
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        out = {
            key: getattr(st, key)
            for key in (
                "st_mode",
                "st_nlink",
                "st_uid",
                "st_gid",
                "st_size",
                "st_blocks",
            )  # fmt: skip
        }
        for key in ("st_atime", "st_mtime", "st_ctime"):
            out[key] = getattr(st, key + "_ns")
        out["st_ino"] = st.st_ino
        return out

    def access(self, path, amode):
        if not os.access(self._full(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path):
        return os.readlink(self._full(path))

    def statfs(self, path):
        sv = os.statvfs(self._full(path))
        return {
            key: getattr(sv, key)
            for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax",
            )
        }  # fmt: skip

    def chmod(self, path, mode):
        full = self._full(path)
        os.chmod(full, mode)
        self.log.append(("chmod", self._id(full), stat.S_IMODE(mode)))
        return 0

    def chown(self, path, uid, gid):
        os.chown(self._full(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        os.utime(self._full(path), ns=times)
        return 0

    # -- the name space --------------------------------------------------------

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def mkdir(self, path, mode):
        parent, name = self._split(path)
        full = self._full(path)
        os.mkdir(full, mode)
        new = self.ids[os.lstat(full).st_ino] = self._new_id()
        mode = stat.S_IMODE(os.lstat(full).st_mode)
        self.log.append(("mkdir", parent, name, new, mode))
        return 0

    def rmdir(self, path):
        parent, name = self._split(path)
        full = self._full(path)
        ident = self._id(full)
        os.rmdir(full)
        self.log.append(("unlink", parent, name, ident))
        return 0

    def unlink(self, path):
        parent, name = self._split(path)
        full = self._full(path)
        ident = self._id(full)
        os.unlink(full)
        self.log.append(("unlink", parent, name, ident))
        return 0

    def symlink(self, target, source):
        raise fuse.FuseOSError(errno.EPERM)  # the store never makes one

    def rename(self, old, new):
        sp, sn = self._split(old)
        dp, dn = self._split(new)
        ident = self._id(self._full(old))
        os.rename(self._full(old), self._full(new))
        self.log.append(("rename", sp, sn, dp, dn, ident))
        return 0

    def link(self, target, source):
        # mfusepy: link(target=new name, source=existing file)
        ident = self._id(self._full(source))
        parent, name = self._split(target)
        os.link(self._full(source), self._full(target))
        self.log.append(("link", ident, parent, name))
        return 0

    # -- files -----------------------------------------------------------------

    def create(self, path, mode, fi=None):
        parent, name = self._split(path)
        full = self._full(path)
        fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        new = self.ids[os.fstat(fd).st_ino] = self._new_id()
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        self.log.append(("create", parent, name, new, mode))
        return fd

    def open(self, path, flags):
        flags &= ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        if flags & os.O_TRUNC:
            raise fuse.FuseOSError(errno.EINVAL)  # the store never does
        return os.open(self._full(path), (flags & ~os.O_ACCMODE) | os.O_RDWR)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        written = os.pwrite(fh, data, offset)
        self.log.append(("write", self._fid(fh), offset, bytes(data[:written])))
        return written

    def truncate(self, path, length, fh=None):
        if fh is None:
            full = self._full(path)
            os.truncate(full, length)
            ident = self._id(full)
        else:
            os.ftruncate(fh, length)
            ident = self._fid(fh)
        self.log.append(("trunc", ident, length))
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        if mode != 0:
            raise fuse.FuseOSError(errno.EOPNOTSUPP)
        os.posix_fallocate(fh, offset, size)
        self.log.append(("falloc", self._fid(fh), offset, size))
        return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)
        self.log.append(("fsync", self._fid(fh)))
        return 0

    def opendir(self, path):
        return os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)

    def releasedir(self, path, fh):
        os.close(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        self.log.append(("fsync", self._fid(fh)))
        return 0

    def destroy(self, path):
        tmp = self.log_path + ".part"
        with open(tmp, "wb") as f:
            pickle.dump(self.log, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.log_path)


def main(argv: list[str]) -> None:
    backing, mountpoint, log_path = argv
    fuse.FUSE(
        RecordFS(backing, log_path), mountpoint, foreground=True, nothreads=True,
        default_permissions=True,
    )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
