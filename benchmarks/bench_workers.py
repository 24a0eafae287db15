"""Fresh-process workers for the side-by-side benchmarks (`vs_trl.py`, `sft_vs_trl.py`, `page_faults.py`).

    result = run_worker(SCRIPT, "tamer", spec)          # parent: `SCRIPT --worker tamer --spec JSON`
    serve(run_tamer, run_trl, args.worker, args.spec)   # the worker's side: run one trainer, print JSON
    results = block_pair(SCRIPT, {"tamer": spec, "trl": spec}, "tamer")   # both alive, steps alternated
    pause(block, warmup, total, done)                   # the worker's side of block_pair, between steps

Each run is its own process, so neither trainer inherits the other's allocator state, threads or
caches. Both sides get the allocator settings tamer's trainers set for themselves
(`tamer.memory.keep_freed_memory`; its result is the row's `malloc`), unless `TAMER_MALLOC=system`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

# Seconds a worker in block mode stays idle after its block, before handing over. After a parallel
# region torch's OpenMP (libgomp) worker threads spin-wait for their next one: measured ~10 ms of one
# core's CPU time after a step (machine d), which the other trainer's next step would otherwise share
# its two cores with. Outside both sides' timed steps; docs/performance.md ("Method").
SETTLE_S = 0.05


def worker_command(script: str, kind: str, spec: dict,
                   env_changes: dict[str, str | None] | None = None) -> tuple[list[str], dict]:
    """The command line and environment of one worker of `script`; `env_changes`: variables set for the
    subprocess only (None: removed from its environment)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return [sys.executable, script, "--worker", kind, "--spec", json.dumps(spec)], env


def run_worker(script: str, kind: str, spec: dict, env_changes: dict[str, str | None] | None = None) -> dict:
    """Run one trainer in a fresh subprocess of `script`; its last stdout line is the JSON result."""
    command, env = worker_command(script, kind, spec, env_changes)
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve(run_tamer: Callable[[dict], dict], run_trl: Callable[[dict], dict], kind: str, spec: str) -> None:
    """The worker process: the allocator settings on, one run of `kind`, its result (with `malloc`) printed."""
    from tamer.memory import keep_freed_memory
    malloc = keep_freed_memory()
    result = (run_tamer if kind == "tamer" else run_trl)(json.loads(spec))
    print(json.dumps({**result, "malloc": malloc}), flush=True)


def pause(block: int | None, warmup: int, total: int, done: int) -> None:
    """Block mode, in a worker that has run `done` of its `total` steps (`warmup` untimed first): after the
    warm-up and after every `block` timed steps but the last, say so on stdout ({"ready": done}) and wait
    for the parent's go on stdin (the other trainer runs meanwhile), after `SETTLE_S` idle. No-op when
    `block` is 0 or None."""
    if block and warmup <= done < total and (done - warmup) % block == 0:
        time.sleep(SETTLE_S)  # this process's OpenMP threads stop spinning before the other trainer starts
        print(json.dumps({"ready": done}), flush=True)
        sys.stdin.readline()


def block_pair(script: str, specs: dict[str, dict], first: str) -> dict[str, dict]:
    """Both trainers (`specs`: kind -> spec; their workers call `pause` between steps) alive at once in
    subprocesses of `script`, running their timed steps in alternating blocks, `first` first and then the
    order flipped every block (A B B A A B ...); only one computes at a time (the other waits on its
    stdin). Warm-ups run one after the other. Returns each side's result (its last JSON line)."""
    procs = {}
    with tempfile.TemporaryFile("w+") as errors:
        def wait_ready(kind: str) -> dict | None:  # the next {"ready": n}, or the final result
            while line := procs[kind].stdout.readline():  # skips what else is printed (HF's log dicts)
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(message, dict) and ("ready" in message or "s_per_step" in message):
                    return None if "ready" in message else message
            errors.seek(0)
            raise RuntimeError(f"{kind} worker ended early:\n{errors.read()[-4000:]}")

        for kind, spec in specs.items():
            command, env = worker_command(script, kind, spec)
            procs[kind] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                           text=True, env=env)
            wait_ready(kind)
        order, results = [first, *(k for k in specs if k != first)], {}
        while len(results) < len(specs):
            for kind in order:
                procs[kind].stdin.write("go\n")
                procs[kind].stdin.flush()
                message = wait_ready(kind)
                if message is not None:  # done: its exit (freeing its memory) ends before the other computes
                    results[kind] = message
                    procs[kind].wait()
            order.reverse()
    return results
