"""The `code` task's config, apart from the task itself (which imports the sandbox).

`tamer.tasks` imports this module to build `TaskConfig`; `tamer.tasks.code` (problems, the
sandboxed `python` environment) is imported only when a config names the task.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tamer.config import PATH, FieldError

DEFAULT_TIMEOUT_S = 5.0  # the sandbox's wall clock for one completion and all its tests
CODE_SOURCE = {**PATH, "keywords": ("builtin",)}  # a path, except the keyword "builtin"


@dataclass(frozen=True)
class CodeConfig:
    """Function-writing problems checked by hidden unit tests in the sandbox."""

    source: str = field(default="builtin", metadata=CODE_SOURCE)  # "builtin" (41 built-in problems) or a JSONL file
    heldout_fraction: float = 0.2  # share of the problems held out for evaluation
    timeout_s: float = DEFAULT_TIMEOUT_S  # sandbox wall clock for one completion and all its tests
    max_workers: int = 0  # sandboxes at once in `CodeTasks.reward()` (0: one per CPU)
    demo_mutation_rate: float = 0.1  # chance the demonstration is an off-by-one variant of the reference
    seed: int = 0  # which problems are held out

    def __post_init__(self) -> None:
        if not self.source:
            raise FieldError("source", 'expected "builtin" or the path of a JSONL file')
        if not 0.0 < self.heldout_fraction < 1.0:
            raise FieldError("heldout_fraction", f"expected a fraction in (0, 1), got {self.heldout_fraction}")
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", f"expected a positive number of seconds, got {self.timeout_s}")
        if self.max_workers < 0:
            raise FieldError("max_workers", f"expected >= 0 (0: one per CPU), got {self.max_workers}")
        if not 0.0 <= self.demo_mutation_rate <= 1.0:
            raise FieldError("demo_mutation_rate", f"expected a probability in [0, 1], got {self.demo_mutation_rate}")
