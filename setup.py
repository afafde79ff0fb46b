"""Declares the C extension only; everything else is in pyproject.toml and setup.cfg."""

import os

from setuptools import Extension, setup

SOURCES = ["module.c", "fileio.c", "checksum.c", "checksum_avx2.c", "copy.c", "uring.c"]
SOURCES += ["ptrs.c", "device.c"]  # raw-address copies; CUDA/ACL calls (dlopen)
# The xxhash header (Debian: libxxhash-dev) enables the GIL-free checksums;
# without it the module builds anyway and npukv_store uses the Python twin.
INCLUDE_DIRS = ["/usr/include", "/usr/local/include"]
INCLUDE_DIRS += [d for d in os.getenv("CPATH", "").split(":") if d]
HAVE_XXHASH = any(os.path.exists(os.path.join(d, "xxhash.h")) for d in INCLUDE_DIRS)

setup(
    ext_modules=[
        Extension(
            "npukv_store._native",
            sources=[f"native/{name}" for name in SOURCES],
            depends=["native/nkv.h", "native/hash_rows.h"],
            define_macros=[("NKV_HAVE_XXHASH", "1")] if HAVE_XXHASH else [],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Werror", "-std=c11"],
            extra_link_args=["-pthread", "-ldl"],  # copy.c's threads, device.c's dlopen
        )
    ]
)
