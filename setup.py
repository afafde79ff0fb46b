"""Declares the C extension only; everything else is in pyproject.toml and setup.cfg."""

import os

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

setup(
    ext_modules=[
        Extension(
            "npukv_store._native",
            sources=[f"native/{name}" for name in SOURCES],
            depends=["native/nkv.h", "native/hash_rows.h"],
            include_dirs=[] if HAVE_SYSTEM_XXHASH else ["native/third_party"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Werror", "-std=c11"],
            extra_link_args=["-pthread", "-ldl"],  # copy.c's threads, device.c's dlopen
        )
    ]
)
