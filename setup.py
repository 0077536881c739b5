"""Builds the C11 kernel core memfit._native from csrc/*.c on install.

Every file is compiled with the same portable flags; ISA-specific functions carry
__attribute__((target(...))) and are chosen at run time, so one wheel runs on any x86-64
(and the scalar path on other CPUs). MEMFIT_SANITIZE=1 builds with ASan/UBSan.
"""

import glob
import os
import platform

from setuptools import Extension, setup

flags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing",
         "-D_GNU_SOURCE"]
link = ["-lpthread", "-lm"]
if os.environ.get("MEMFIT_SANITIZE"):
    flags += ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    link += ["-fsanitize=address,undefined"]
if platform.machine() in ("x86_64", "AMD64"):
    flags += ["-mf16c"] if os.environ.get("MEMFIT_ASSUME_F16C") else []

setup(
    ext_modules=[
        Extension(
            "memfit._native",
            sources=sorted(glob.glob("csrc/*.c")),
            include_dirs=["csrc"],
            extra_compile_args=flags,
            extra_link_args=link,
        )
    ]
)
