"""Peak resident memory of a call on CPU (Linux), in the current process.

There is no CPU counterpart of ``torch.cuda.max_memory_allocated``; this measures the
process's resident set instead: glibc is told to serve every allocation of 64 KiB or more with
``mmap`` (so freed tensors leave the resident set at once), the kernel's high-water mark is
reset through ``/proc/self/clear_refs``, and ``VmHWM − VmRSS`` after the call is the peak extra
memory it needed. Small allocations (< 64 KiB) are not seen; attention buffers are far larger.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Callable

__all__ = ["peak_extra_bytes", "supported"]

_M_MMAP_THRESHOLD = -3
_configured = False


def _configure() -> bool:
    global _configured
    if not _configured:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _configured = bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024))
    return _configured


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def supported() -> bool:
    try:
        _status("VmHWM")
        with open("/proc/self/clear_refs", "w"):
            pass
        return _configure()
    except OSError:
        return False


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Bytes above the current resident set that ``fn()`` needed at its peak."""
    if not supported():
        raise OSError("peak memory needs Linux /proc and glibc")
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")                      # reset VmHWM to the current VmRSS
    before = _status("VmRSS")
    result = fn()
    peak = _status("VmHWM")
    del result
    return max(0, peak - before)
