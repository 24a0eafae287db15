"""Checking a completion of a `code` task: run its code against the hidden tests in the sandbox.

    outcome = check_completion(text, task)          # UnitTestOutcome(passed=3, total=5, ...)
    unit_tests(traj)                                # the `unit_tests` reward: passed / total
    traj.info["tests_passed"], traj.info["tests_total"], traj.info["sandbox_limit"]

    with UnitTestReward(max_workers=8) as reward:   # many completions at once on a SandboxPool
        reward.score_batch(trajectories)            # fills traj.info; a later unit_tests(traj) reads it back

The code is the last ```python block of the completion (or, without one, the whole text). A
harness runs in the sandbox (tamer.tools.sandbox): it loads the code, then runs each hidden test
in try/except, counting passes, and prints one result line that starts with a random nonce it
read from stdin, so a program that merely prints, exits early (`sys.exit(0)`) or raises gets no
credit it did not earn. No code, code that fails to load (a syntax error), a limit hit (an
infinite loop hits the timeout) or a missing result line all score 0.0, and `traj.info` says
why: "code_block", "code_error", "sandbox_limit", "test_failure" (the first failing test).
What it cannot stop: the program runs in the harness's process, so code written to subvert the
check (read the nonce from the harness's frames, or return an object whose `__eq__` is always
True) can forge a score; read a sample of high-reward completions when a run looks too good.

Why both a function and a class: `RewardComposer` calls reward functions one trajectory at a
time, so the registered `unit_tests` runs one sandbox per call. A trainer that wants a batch
checked in parallel calls `UnitTestReward.score_batch` first; the results are recorded in
`traj.info`, which `unit_tests` reads back instead of running again. `tamer.rewards` registers
`unit_tests` (this module must not import `tamer.rewards`: that imports `tamer.tasks`, which
imports this module).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tamer.tasks.base import Task
from tamer.tasks.code_config import DEFAULT_TIMEOUT_S
from tamer.tools.sandbox import SandboxConfig, SandboxPool, SandboxResult, run_python

if TYPE_CHECKING:
    from tamer.rollout.types import Trajectory

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^|>\s]*\|>")  # <|im_end|> and the like, kept in decoded text

# Runs in the sandbox. Reads "nonce\n" + JSON {code, tests} from stdin before the program runs,
# so neither is in a file or argv; os._exit ends the run at once, threads the program left included.
HARNESS = '''\
import json, os, sys

def describe(exc):
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:
        return type(exc).__name__

nonce = sys.stdin.readline().strip()
job = json.loads(sys.stdin.read())
out, report = sys.stdout, {"passed": 0, "error": None, "failure": None}
sys.stdout = open(os.devnull, "w")  # the program's prints must not reach the result line
namespace = {"__name__": "solution"}
try:
    exec(compile(job["code"], "solution.py", "exec"), namespace)
except BaseException as exc:
    report["error"] = describe(exc)
else:
    for i, test in enumerate(job["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), namespace)
            report["passed"] += 1
        except BaseException as exc:
            report["failure"] = report["failure"] or f"test {i}: {describe(exc)}"
out.write(nonce + json.dumps(report) + "\\n")
out.flush()
os._exit(0)
'''


def extract_code(text: str) -> tuple[str, bool]:
    """(code, in_block): the last ```python (or unlabeled) block, an unclosed one included (a reply
    cut off by the token limit); else the whole text, in case the model skipped the fence."""
    text = _SPECIAL_TOKEN_RE.sub("", text)
    blocks = _FENCE_RE.findall(text)
    return (blocks[-1], True) if blocks else (text, False)


@dataclass(frozen=True)
class UnitTestOutcome:
    """What the hidden tests said about one completion."""

    passed: int
    total: int
    code_block: bool = True  # False: no ```python block, so the whole text was tried as code
    limit: str | None = None  # the sandbox limit the run hit (timeout, memory, output, ...)
    error: str | None = None  # why the code could not be tested (e.g. "SyntaxError: ...")
    failure: str | None = None  # the first failing test, in one line

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def record(self, info: dict[str, Any]) -> None:
        info.update(tests_passed=self.passed, tests_total=self.total, code_block=self.code_block,
                    sandbox_limit=self.limit, code_error=self.error, test_failure=self.failure)


@dataclass(frozen=True)
class _Job:
    total: int
    nonce: str
    stdin: str

    code_block: bool

    def finish(self, result: SandboxResult) -> UnitTestOutcome:
        report = self._report(result.stdout)
        if result.limit_hit is not None or report is None:
            status = f"signal {result.signal}" if result.signal else f"exit status {result.exit_code}"
            error = None if result.limit_hit else f"no test result ({status})"
            return UnitTestOutcome(0, self.total, self.code_block, limit=result.limit_hit, error=error)
        return UnitTestOutcome(report["passed"], self.total, self.code_block,
                               error=_short(report.get("error")), failure=_short(report.get("failure")))

    def _report(self, stdout: str) -> dict | None:
        lines = [line for line in stdout.splitlines() if line.startswith(self.nonce)]
        try:
            report = json.loads(lines[-1][len(self.nonce):]) if lines else None
        except ValueError:
            return None
        ok = isinstance(report, dict) and type(report.get("passed")) is int and 0 <= report["passed"] <= self.total
        return report if ok else None


def _short(text: Any) -> str | None:
    return None if text is None else str(text)[:300]


def prepare(text: str, task: Task) -> _Job | UnitTestOutcome:
    """The sandbox job for a completion, or its outcome right away when it holds no code."""
    tests = task.meta.get("tests")
    if not tests:
        raise ValueError(f"task {task.id} has no hidden tests in meta['tests']; unit_tests scores code tasks")
    code, in_block = extract_code(text)
    if not code.strip():
        return UnitTestOutcome(0, len(tests), in_block, error="no code in the completion")
    nonce = secrets.token_hex(16)
    return _Job(len(tests), nonce, nonce + "\n" + json.dumps({"code": code, "tests": list(tests)}), in_block)


def sandbox_for(task: Task, timeout_s: float | None = None, memory_mb: int = 512) -> SandboxConfig:
    return SandboxConfig(timeout_s=timeout_s or task.meta.get("timeout_s", DEFAULT_TIMEOUT_S), memory_mb=memory_mb)


def check_completion(text: str, task: Task, config: SandboxConfig | None = None) -> UnitTestOutcome:
    """Run the completion's code against the task's hidden tests (one sandbox run)."""
    job = prepare(text, task)
    if isinstance(job, UnitTestOutcome):
        return job
    return job.finish(run_python(HARNESS, config or sandbox_for(task), stdin=job.stdin))


def _cached(traj: Trajectory) -> float | None:
    """The score recorded by an earlier check of this trajectory (e.g. `score_batch`), if any."""
    info = traj.info
    return info["tests_passed"] / info["tests_total"] if info.get("tests_total") else None


def unit_tests(traj: Trajectory, *, timeout_s: float | None = None, memory_mb: int = 512) -> float:
    """Fraction of the task's hidden unit tests that the completion's code passes (see the module
    docstring); details go to traj.info. One sandbox run per call, unless already scored."""
    cached = _cached(traj)
    if cached is not None:
        return cached
    outcome = check_completion(traj.text, traj.task, sandbox_for(traj.task, timeout_s, memory_mb))
    outcome.record(traj.info)
    return outcome.score


class UnitTestReward:
    """The `unit_tests` reward on a SandboxPool: `score_batch` checks many completions at once and
    records them in traj.info, so that `unit_tests` (or this object, called) reads them back."""

    def __init__(self, max_workers: int | None = None, *, timeout_s: float | None = None, memory_mb: int = 512):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.pool = SandboxPool(max_workers)

    def score_batch(self, trajectories: Iterable[Trajectory]) -> list[float]:
        trajectories = list(trajectories)
        running = []
        for traj in trajectories:
            if _cached(traj) is not None:
                continue
            job = prepare(traj.text, traj.task)
            if isinstance(job, UnitTestOutcome):
                job.record(traj.info)
                continue
            config = sandbox_for(traj.task, self.timeout_s, self.memory_mb)
            running.append((traj, job, self.pool.submit(HARNESS, stdin=job.stdin, config=config)))
        for traj, job, future in running:
            job.finish(future.result()).record(traj.info)
        return [_cached(traj) or 0.0 for traj in trajectories]

    def __call__(self, traj: Trajectory) -> float:
        return self.score_batch([traj])[0]

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> UnitTestReward:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
