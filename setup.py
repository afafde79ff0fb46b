"""Declares the C extension only; everything else is in pyproject.toml and setup.cfg."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "npukv_store._native",
            sources=["native/module.c", "native/fileio.c"],
            depends=["native/nkv.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror", "-std=c11"],
        )
    ]
)
