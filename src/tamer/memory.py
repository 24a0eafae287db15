"""Memory readings of this process, in MB: resident now and at its peak; the memory still available.

    current_rss_mb()   # VmRSS
    peak_rss_mb()      # VmHWM: the high-water mark since the process started
    available_mb()     # MemAvailable, or less under a cgroup (container) limit; None where unknown
    cpu_info()         # /proc/cpuinfo's fields (model name, flags, ...); {} where unreadable
    cpu_vendor()       # GenuineIntel, AuthenticAMD, ...: which CPU kernels pay off (fast_forward.MKL_PACKED)
    keep_freed_memory()  # glibc malloc reuses freed tensor memory instead of faulting in fresh pages

Read from /proc/self/status on Linux (getrusage elsewhere). A process's peak is its own:
to compare methods, run each in its own process (`tamer.phases.run_in_child`). On Linux a
child's `ru_maxrss` starts from its parent's RSS at fork and `RUSAGE_CHILDREN` is a maximum
over all children, which is why neither is used.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path


def _proc_status_mb(key: str, path: Path = Path("/proc/self/status")) -> float | None:
    """The `key:  N kB` line of a /proc file (status, meminfo) in MB; None if absent or unreadable."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MB
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss_mb() -> float:
    """Resident set size of this process now, in MB."""
    value = _proc_status_mb("VmRSS")
    return value if value is not None else peak_rss_mb()


def rss_parts_mb() -> dict[str, float | None]:
    """This process's resident memory now, by kind (MB): `anon` (heap, tensors), `file` (mapped
    libraries and files), `shmem`; what a peak RSS that moves between runs of the same work is made of."""
    return {kind.lower(): _proc_status_mb(f"Rss{kind}") for kind in ("Anon", "File", "Shmem")}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), in MB."""
    value = _proc_status_mb("VmHWM")
    if value is not None:
        return value
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux/BSD, bytes on macOS
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def available_mb(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Memory that can still be allocated, in MB: the kernel's MemAvailable, capped by the cgroup v2
    limit (`memory.max` - `memory.current`) a container runs under. None where neither is readable."""
    kernel = _proc_status_mb("MemAvailable", meminfo)
    found = [] if kernel is None else [kernel]
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append((int(limit) - int((cgroup / "memory.current").read_text())) / 2**20)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The `key : value` fields of /proc/cpuinfo (`vendor_id`, `model name`, `flags`, ...; the last
    processor's where they repeat); {} where it is not readable (not Linux)."""
    fields = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's `vendor_id` (`GenuineIntel`, `AuthenticAMD`, ...); None where /proc/cpuinfo is not
    readable or has no such line (not Linux, or an architecture without it)."""
    return cpu_info(cpuinfo).get("vendor_id")


# glibc's mallopt parameters (malloc.h) and the values tamer sets (`keep_freed_memory`).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest M_MMAP_THRESHOLD on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top is returned to the OS only past 1 GiB
MALLOC_ENV = "TAMER_MALLOC"  # "system": leave malloc as it is
_malloc_result: str | None = None  # the first call's result


def keep_freed_memory() -> str:
    """Let glibc's malloc keep freed blocks of up to 32 MiB for reuse; returns what was done.

    With glibc's defaults a freed tensor of more than 128 KiB goes back to the OS (munmap, or a
    trimmed heap top) once its size no longer fits the threshold glibc adjusts as it goes, and the
    next tensor of that size faults its pages in again: a median 6,670 page faults per step of the
    1M GRPO benchmark step on a 2-core VM. Fixing M_MMAP_THRESHOLD at 32 MiB and M_TRIM_THRESHOLD
    at 1 GiB keeps that memory in the process: the same step takes none and runs in 0.88 of the
    time (median of 10 alternated pairs; docs/performance.md, "What tamer does to be fast", 12).
    A process's peak RSS stays what its live tensors need (freed memory is reused, not grown); its
    RSS does not shrink after the peak.

    Returns "set", "already set" (an earlier call), "off" (TAMER_MALLOC=system, or GLIBC_TUNABLES
    already sets a malloc tunable: the user's choice wins) or "unavailable" (no glibc).
    Once per process; later calls return the first call's result ("already set" when it was "set").
    """
    global _malloc_result
    if _malloc_result is not None:
        return "already set" if _malloc_result == "set" else _malloc_result
    _malloc_result = _set_malloc_options()
    return _malloc_result


def _set_malloc_options() -> str:
    if os.environ.get(MALLOC_ENV, "").lower() == "system" or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "off"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "unavailable"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "set" if ok else "unavailable"
