"""Kernel tests skip only on a CPU that lacks what they need, and run on every build this CPU
can run.

A fused-kernel test that skips where it could have run hides work: the CPU has AVX2 or
AVX512-BF16 (or AMX), but the kernel did not build, the feature check was wrong, or the OS
refused the tiles. `.ci/run` sets CDLM_REQUIRE_CPU_KERNELS=1, and then such a skip is a failure
wherever /proc/cpuinfo shows the feature; on a developer's machine without the flag it stays a
skip. The kernels have a build per instruction set (models/kernels: avx512, avx2); a test
module parametrized over `ISAS` with `kernel_build` runs each of its tests on each build the
CPU can run: an AVX512 machine tests the AVX2 build too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest

REQUIRED = os.environ.get("CDLM_REQUIRE_CPU_KERNELS") == "1"

# What each kernel family needs, as /proc/cpuinfo spells the flags.
NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),  # x86-64-v3: the AVX2 build
    "avx512-bf16": ("avx512_bf16", "avx512bw", "avx512_vnni"),  # VNNI: the int8 kernels
    "amx-bf16": ("amx_bf16", "amx_tile"),
    "amx-int8": ("amx_int8", "amx_tile"),
}


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has(feature: str) -> bool:
    return all(flag in cpu_flags() for flag in NEEDS[feature])


def skip_unless(feature: str, usable: bool, what: str) -> None:
    """Skip the calling test when `usable` is false (the kernels for `feature` cannot run
    here); with CDLM_REQUIRE_CPU_KERNELS=1, fail instead where the CPU has the feature."""
    if usable:
        return
    if REQUIRED and cpu_has(feature):
        pytest.fail(
            f"this CPU has {feature} ({', '.join(NEEDS[feature])} in /proc/cpuinfo) but {what} "
            "is not usable: the kernel did not build, or its feature check is wrong"
        )
    pytest.skip(f"{what}: this CPU lacks {feature}")


# The kernel builds (models/kernels `BUILDS`) and the feature each needs.
ISAS = ("avx2", "avx512")
FEATURE = {"avx2": "avx2", "avx512": "avx512-bf16"}


@contextmanager
def kernel_build(isa: str) -> Iterator[None]:
    """Inside: models.kernels runs `isa`'s build (forced as CDLM_SERVE_CPU_ISA does), or the
    calling test skips (fails with CDLM_REQUIRE_CPU_KERNELS=1 where the CPU has the feature).
    After: the build this CPU picks by itself again."""
    from cdlm_serve.models import kernels

    skip_unless(FEATURE[isa], kernels.cpu_has(isa), f"the fused CPU kernels ({isa})")
    saved = os.environ.get(kernels.ISA_ENV)
    os.environ[kernels.ISA_ENV] = isa
    try:
        assert kernels.enable_cpu_kernels(), f"the {isa} kernels failed to build on a capable CPU"
        assert kernels.active_isa() == isa
        yield
    finally:
        if saved is None:
            os.environ.pop(kernels.ISA_ENV, None)
        else:
            os.environ[kernels.ISA_ENV] = saved
        kernels.enable_cpu_kernels()
