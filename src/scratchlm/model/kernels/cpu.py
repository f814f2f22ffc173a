"""What this CPU can do, as the speed paths must ask before they use an instruction-set feature.

Two sources must both agree, because either can say no:
- torch's dispatch level, `torch.backends.cpu.get_cpu_capability()` ("AVX2", "AVX512", ...), which honours
  `ATEN_CPU_CAPABILITY` (so `ATEN_CPU_CAPABILITY=avx2` makes an AVX-512 machine behave as an AVX2 one), and
  oneDNN's ceiling `ONEDNN_MAX_CPU_ISA` (oneDNN's own kernels, e.g. the packed weights, obey it);
- the hardware's flags (CPUID, read by torch): bf16 arithmetic needs AVX512-BF16 or AMX.

A feature is used only when both allow it; otherwise the plain path runs. `describe()` is the line every
benchmark prints beside its figures.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) that stop below AVX-512: its bf16 kernels then cannot run.
_ONEDNN_BELOW_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}


def capability() -> str:
    """torch's CPU dispatch level: "DEFAULT", "AVX2", "AVX512", ... (honours ATEN_CPU_CAPABILITY)."""
    return torch.backends.cpu.get_cpu_capability()


def _onednn_allows_avx512() -> bool:
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return isa not in _ONEDNN_BELOW_AVX512


def has_native_bf16() -> bool:
    """Whether bf16 matrix products run on bf16 instructions here (AVX512-BF16 or AMX) rather than emulated:
    what makes bf16 training and bf16-packed decoding faster than float32. False on AVX2-only CPUs, and on any
    CPU held to AVX2 by ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA."""
    if not capability().startswith("AVX512") or not _onednn_allows_avx512():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@functools.cache
def model_name() -> str:
    """The CPU's model name ("AMD EPYC 7B13", ...), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """One line naming the CPU, torch's vector ISA and whether bf16 is native: "AMD EPYC, AVX512, bf16 native"."""
    bf16 = "bf16 native" if has_native_bf16() else "bf16 emulated"
    return f"{model_name()}, {capability()}, {bf16}, {torch.get_num_threads()} threads"
