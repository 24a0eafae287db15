"""`SandboxPool`: many sandboxed runs at once, for rollouts and reward checks."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tamer.tools.sandbox.config import SandboxConfig, SandboxResult
from tamer.tools.sandbox.run import run_python


class SandboxPool:
    """Runs up to `max_workers` sandboxes at once. Threads suffice: the work is in child processes,
    and each run leases its own uid, so concurrent runs cannot see or signal each other."""

    def __init__(self, max_workers: int | None = None, config: SandboxConfig = SandboxConfig()):
        max_workers = max_workers or os.cpu_count() or 1
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tamer-sandbox")

    def submit(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None,
               config: SandboxConfig | None = None) -> Future[SandboxResult]:
        return self._executor.submit(run_python, code, config or self.config, stdin=stdin, files=files)

    def map(self, codes: Iterable[str], *, stdins: Sequence[str] | None = None) -> list[SandboxResult]:
        """Run every code; results in input order."""
        codes = list(codes)
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError(f"stdins has {len(stdins)} entries for {len(codes)} codes")
        futures = [self.submit(code, stdin=text) for code, text in zip(codes, stdins)]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
