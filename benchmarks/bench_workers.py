"""Fresh-process workers for the side-by-side benchmarks (`vs_trl.py`, `sft_vs_trl.py`, `page_faults.py`).

    result = run_worker(SCRIPT, "tamer", spec)          # parent: `SCRIPT --worker tamer --spec JSON`
    serve(run_tamer, run_trl, args.worker, args.spec)   # the worker's side: run one trainer, print JSON

Each run is its own process, so neither trainer inherits the other's allocator state, threads or
caches. Both sides get the allocator settings tamer's trainers set for themselves
(`tamer.memory.keep_freed_memory`; its result is the row's `malloc`), unless `TAMER_MALLOC=system`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable


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
