"""Memory readings of this process, in MB: resident now and at its peak; the memory still available.

    current_rss_mb()   # VmRSS
    peak_rss_mb()      # VmHWM: the high-water mark since the process started
    available_mb()     # MemAvailable, or less under a cgroup (container) limit; None where unknown
    cpu_info()         # /proc/cpuinfo's fields (model name, flags, ...); {} where unreadable
    cpu_vendor()       # GenuineIntel, AuthenticAMD, ...: which CPU kernels pay off (fast_forward.MKL_PACKED)

Read from /proc/self/status on Linux (getrusage elsewhere). A process's peak is its own:
to compare methods, run each in its own process (`tamer.phases.run_in_child`). On Linux a
child's `ru_maxrss` starts from its parent's RSS at fork and `RUSAGE_CHILDREN` is a maximum
over all children, which is why neither is used.
"""

from __future__ import annotations

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
