"""Kernel tests skip only on a CPU that lacks what they need.

A fused-kernel test that skips where it could have run hides work: the CPU has AVX512-BF16
(or AMX), but the kernel did not build, the feature check was wrong, or the OS refused the
tiles. `.ci/run` sets CDLM_REQUIRE_CPU_KERNELS=1, and then such a skip is a failure wherever
/proc/cpuinfo shows the feature; on a developer's machine without the flag it stays a skip.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

REQUIRED = os.environ.get("CDLM_REQUIRE_CPU_KERNELS") == "1"

# What each kernel family needs, as /proc/cpuinfo spells the flags.
NEEDS = {
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
