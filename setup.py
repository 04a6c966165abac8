"""Native extensions of scratchd (everything else is declared in pyproject.toml).

Each extension is plain C against the CPython API (no numpy headers, no Cython), built by
the same ``pip install -e .`` as the rest: the only build requirement is a C compiler and
the Python headers, which every supported Linux machine has.
"""

from setuptools import Extension, setup

CFLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

EXTENSIONS: list[Extension] = [
    # Each entry: Extension("scratchd.<subpkg>._<name>", ["<subpkg>/_<name>.c"], ...)
    Extension(
        "scratchd.ipc._native",
        ["ipc/_native.c"],
        depends=["ipc/layout_fields.h"],
        extra_compile_args=CFLAGS,
    ),
    Extension(
        "scratchd.ipc._results",
        ["ipc/_results.c"],
        depends=["ipc/layout_fields.h"],
        extra_compile_args=CFLAGS,
    ),
    Extension(
        "scratchd.cpu._cpu",
        ["cpu/_cpu.c"],
        depends=["cpu/_cpu_kernels.h"],
        extra_compile_args=[*CFLAGS, "-Wno-psabi"],
    ),
    Extension("scratchd.cpu._runs", ["cpu/_runs.c"], extra_compile_args=CFLAGS),
]

setup(ext_modules=EXTENSIONS)
