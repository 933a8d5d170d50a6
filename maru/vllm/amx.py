"""Intel AMX tiles for vLLM's CPU attention, in an engine whose first forward is a hit.

vLLM's CPU attention runs AMX kernels where the CPU has AMX tiles and the cache is
bf16 in blocks of a multiple of 32 (`vllm.v1.attention.backends.cpu_attn`, seen on
0.32), but never asks Linux for them: a process may use AMX tile data only after
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; before that, the first tile
instruction kills it with SIGILL. oneDNN asks when its own bf16 kernels first run,
which a prefill's matrix products do, so an engine without maru always has. A maru
hit can be a new engine's first forward and compute one token over a long loaded
prefix, which runs no such kernel, and vLLM's attention then dies in its first tile
instruction. So the worker asks, once, where the KV cache is on the CPU.
"""

from __future__ import annotations

import ctypes
import errno
import platform

from maru.log import get_logger

log = get_logger(__name__)

SYS_ARCH_PRCTL = 158
"""arch_prctl(2)'s number on x86-64 Linux."""
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18
"""The state component of AMX tile data (Linux's `arch/x86/include/asm/fpu/types.h`)."""

_libc = ctypes.CDLL(None, use_errno=True)


def on_x86_64_linux() -> bool:
    """Where AMX and arch_prctl(2) exist at all."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def amx_tiles_permitted() -> bool:
    """May this process use AMX tile data (False where there is none)?"""
    if not on_x86_64_linux():
        return False
    features = ctypes.c_uint64(0)
    if _libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value >> XFEATURE_XTILEDATA & 1)


def permit_amx_tiles() -> bool:
    """Ask Linux for AMX tile data for this process; True where it is permitted now
    (False where the CPU or kernel has no AMX: nothing to do there)."""
    if not on_x86_64_linux():
        return False
    if amx_tiles_permitted():
        return True
    if _libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        error = ctypes.get_errno()
        if error not in (errno.EOPNOTSUPP, errno.EINVAL):  # no AMX in this CPU or kernel
            log.warning("maru: asking Linux for AMX tile data failed: %s", errno.errorcode[error])
        return False
    log.info("maru: AMX tile data permitted in this process (vLLM's CPU attention uses AMX)")
    return True
