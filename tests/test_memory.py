"""`tamer.memory.keep_freed_memory`: glibc's malloc keeps freed tensor memory for reuse (each case in
its own process: the setting is process-wide)."""

import ctypes
import json
import os
import subprocess
import sys

import pytest

# A 24 MiB tensor made and freed; glibc's own counters (mallinfo2) say where its memory came from
# and whether the process still holds it, free, afterwards.
ONE_TENSOR = """
import ctypes, json, sys, torch
from tamer.memory import keep_freed_memory
results = [keep_freed_memory() for _ in range(int(sys.argv[1]))]
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
before = libc.mallinfo2()
x = torch.ones(6 << 20)
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(json.dumps({"results": results, "mmapped_mb": (during.hblkhd - before.hblkhd) / 2**20,
                  "held_free_mb": (after.fordblks - before.fordblks) / 2**20}))
"""


def _run(calls: int, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("TAMER_MALLOC", "GLIBC_TUNABLES")} | env
    out = subprocess.run([sys.executable, "-c", ONE_TENSOR, str(calls)], env=full, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2)")
def test_a_freed_tensor_stays_in_the_process_for_reuse():
    kept = _run(2)
    assert kept["results"] == ["set", "already set"]
    assert kept["mmapped_mb"] == 0 and kept["held_free_mb"] >= 24, kept  # from the heap, and kept there
    system = _run(1, TAMER_MALLOC="system")
    assert system["results"] == ["off"]
    # glibc's default: a fresh process maps a 24 MiB block on its own and unmaps it when freed.
    assert system["mmapped_mb"] >= 24 and system["held_free_mb"] < 24, system


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2)")
def test_a_users_glibc_tunables_win():
    tuned = _run(1, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1048576")
    assert tuned["results"] == ["off"]
    assert tuned["mmapped_mb"] >= 24, tuned  # the user's 1 MiB threshold, not tamer's 32 MiB


RSS_PARTS = """
import json, torch
from tamer.memory import current_rss_mb, rss_parts_mb
before = rss_parts_mb()
rss = current_rss_mb()
x = torch.ones(16 << 20)  # 64 MiB, written: resident
print(json.dumps({"parts": sum(before.values()), "rss": rss, "grown": rss_parts_mb()["anon"] - before["anon"]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_rss_parts_add_up_to_the_rss_and_a_new_tensor_is_anonymous():
    """In a process of its own: the kernel's RSS counters are approximate per CPU, and a test process
    that earlier tests left with many threads and much freed memory read 0-58 MB for this tensor."""
    out = subprocess.run([sys.executable, "-c", RSS_PARTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(got["parts"] - got["rss"]) < 8, got  # the kernel's three counters make VmRSS
    assert 60 < got["grown"] < 72, got
