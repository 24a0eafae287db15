"""Sandbox throughput and overhead, printed as one JSON object.

    python benchmarks/sandbox_bench.py [--runs 40]

Measures, for the trivial program `print(1)`:
  * sandbox runs per second with 1 and with 2 concurrent workers (SandboxPool),
  * mean and median latency of one sandboxed run,
  * mean latency of the same interpreter started plainly (`python -E -s -u -c "print(1)"`),
  * the sandbox's overhead over that plain start, in milliseconds and as a ratio,
  * the median latency with and without the run's PID namespace and reaper (interleaved).
Each measurement is preceded by warm-up runs (the first run of a uid creates its network namespace).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from tamer.tools.sandbox import SandboxConfig, SandboxPool, run_python

PROGRAM = "print(1)"


def plain_latencies(runs: int, python: str) -> list[float]:
    """Wall time of starting the interpreter directly: the floor any process sandbox sits on."""
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([python, "-E", "-s", "-u", "-c", PROGRAM], capture_output=True, check=True)
        out.append(time.perf_counter() - start)
    return out


def sandbox_latencies(runs: int, config: SandboxConfig) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_python(PROGRAM, config)
        out.append(time.perf_counter() - start)
        assert result.ok and result.stdout == "1\n", result
    return out


def pidns_cost(runs: int, config: SandboxConfig) -> dict[str, float]:
    """Median latency with and without the PID namespace + reaper, runs interleaved."""
    without = dataclasses.replace(config, pid_namespace=False)
    on, off = [], []
    for _ in range(runs):
        on += sandbox_latencies(1, config)
        off += sandbox_latencies(1, without)
    return {"with_pidns_median_ms": round(1000 * statistics.median(on), 2),
            "without_pidns_median_ms": round(1000 * statistics.median(off), 2)}


def pool_throughput(runs: int, workers: int, config: SandboxConfig) -> float:
    with SandboxPool(max_workers=workers, config=config) as pool:
        pool.map([PROGRAM] * (2 * workers))  # warm-up: one network namespace per uid in use
        start = time.perf_counter()
        results = pool.map([PROGRAM] * runs)
        elapsed = time.perf_counter() - start
    assert all(r.ok for r in results)
    return runs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs per measurement")
    args = parser.parse_args()
    config = SandboxConfig(timeout_s=10)

    probe = run_python(PROGRAM, config)  # also the warm-up of the sequential path
    sandbox_latencies(3, config)
    plain_latencies(3, config.python)
    sandboxed = sandbox_latencies(args.runs, config)
    plain = plain_latencies(args.runs, config.python)
    mean_sandboxed, mean_plain = statistics.mean(sandboxed), statistics.mean(plain)
    report = {
        "benchmark": "sandbox",
        "program": PROGRAM,
        "runs": args.runs,
        "runs_per_s_1_worker": round(pool_throughput(args.runs, 1, config), 2),
        "runs_per_s_2_workers": round(pool_throughput(args.runs, 2, config), 2),
        "sandbox_latency_mean_ms": round(1000 * mean_sandboxed, 2),
        "sandbox_latency_median_ms": round(1000 * statistics.median(sandboxed), 2),
        "plain_python_latency_mean_ms": round(1000 * mean_plain, 2),
        "overhead_ms": round(1000 * (mean_sandboxed - mean_plain), 2),
        "overhead_ratio": round(mean_sandboxed / mean_plain, 2),
        "pidns": pidns_cost(args.runs, config),
        "protections": list(probe.protections),
        "warnings": list(probe.warnings),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform(), "euid": os.geteuid()},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
