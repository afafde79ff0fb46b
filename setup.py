"""Declares the C extension only; everything else is in pyproject.toml and setup.cfg."""

import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile

from setuptools import Extension, setup

SOURCES = ["module.c", "fileio.c", "checksum.c", "checksum_avx2.c", "copy.c", "uring.c"]
SOURCES += ["ptrs.c", "device.c"]  # raw-address copies; CUDA/ACL calls (dlopen)
SOURCES += ["stream_avx2.c"]  # non-temporal copies (x86-64 with AVX2 at run time)
# The xxhash header (header-only with XXH_INLINE_ALL) gives the GIL-free
# checksums. The system's (Debian: libxxhash-dev) is used where installed;
# elsewhere the copy of xxHash 0.8.1 (BSD-2-Clause, its notice inside) in
# native/third_party, so every build has them (a build once made without a
# header read cached chunks 3.5x slower on a 16-core host; docs/decisions/0016).
SYSTEM_DIRS = ["/usr/include", "/usr/local/include"]
SYSTEM_DIRS += [d for d in os.getenv("CPATH", "").split(":") if d]
HAVE_SYSTEM_XXHASH = any(
    os.path.isfile(os.path.join(d, "xxhash.h")) for d in SYSTEM_DIRS
)

# Hardening (security review finding 9): Debian's gcc enables none of these by
# default, and the interpreter's CFLAGS (here -fwrapv -O3) add none. Each is
# kept only where a tiny program compiles and links with it warning-free (an
# old gcc, clang, another architecture), so the build never fails for one;
# tests/security/test_native.py checks what the built module carries.
#   -fstack-protector-strong  canaries in functions with arrays (__stack_chk_fail)
#   _FORTIFY_SOURCE=2         glibc's checked calls (*_chk) where sizes are known;
#                             needs -O1 or more (the -O3 below). Undefined first:
#                             an interpreter built with another level passes its
#                             own -D, and redefining it is a warning (-Werror).
#                             A level of 3 from the interpreter is kept.
#   -fcf-protection           CET: endbr64 landing pads and shadow-stack marks (x86)
#   -z relro -z now           GOT read-only after start-up (GNU_RELRO + BIND_NOW)
WARNINGS = ["-Wall", "-Wextra", "-Werror"]
PROBE_SOURCE = """\
#include <string.h>
int nkv_probe(const char *s, unsigned n);
int nkv_probe(const char *s, unsigned n)
{
    char buf[64];
    memcpy(buf, s, n < sizeof(buf) ? n : sizeof(buf));
    return buf[0];
}
"""


def _compiler() -> list[str]:
    """The C compiler setuptools will run (CC overrides the interpreter's)."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _probe(compile_args: list[str], link_args: tuple[str, ...] = ()) -> bool:
    """Whether a tiny shared object builds with these flags and no warning."""
    with tempfile.TemporaryDirectory(prefix="npukv-probe-") as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write(PROBE_SOURCE)
        command = _compiler() + ["-O3", *WARNINGS, "-fPIC", "-shared", *compile_args]
        command += [source, "-o", os.path.join(tmp, "probe.so"), *link_args]
        try:
            done = subprocess.run(command, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0 and not done.stderr.strip()


def _fortify_level() -> int:
    """2, or 3 where the interpreter's own CFLAGS already ask for it."""
    flags = " ".join(
        os.environ.get(name) or sysconfig.get_config_var(name) or ""
        for name in ("CFLAGS", "CPPFLAGS")
    )
    return 3 if "-D_FORTIFY_SOURCE=3" in flags else 2


def hardening() -> tuple[list[str], list[str]]:
    """(compile args, link args): each hardening flag this compiler takes."""
    candidates = [
        ["-fstack-protector-strong"],
        ["-U_FORTIFY_SOURCE", f"-D_FORTIFY_SOURCE={_fortify_level()}"],
    ]
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        candidates.append(["-fcf-protection"])
    compile_args = [flag for flags in candidates if _probe(flags) for flag in flags]
    relro = ["-Wl,-z,relro,-z,now"]
    return compile_args, relro if _probe([], tuple(relro)) else []


HARDEN_COMPILE, HARDEN_LINK = hardening()

setup(
    ext_modules=[
        Extension(
            "npukv_store._native",
            sources=[f"native/{name}" for name in SOURCES],
            depends=["native/nkv.h", "native/hash_rows.h"],
            include_dirs=[] if HAVE_SYSTEM_XXHASH else ["native/third_party"],
            extra_compile_args=["-O3", *WARNINGS, "-std=c11", *HARDEN_COMPILE],
            # copy.c's threads, device.c's dlopen
            extra_link_args=["-pthread", "-ldl", *HARDEN_LINK],
        )
    ]
)
