"""Task sources: built-in generators and the user's own datasets, chosen by name."""

from __future__ import annotations

from dataclasses import dataclass, field

from tamer.tasks.arithmetic import ArithmeticConfig, ArithmeticTasks
from tamer.tasks.base import TASK_SOURCES, Task, TaskPool, TaskSource, extract_answer, is_correct
from tamer.tasks.calculator import CalculatorConfig, CalculatorTasks
from tamer.tasks.code import CodeConfig, CodeTasks
from tamer.tasks.dataset import DatasetConfig, DatasetError, DatasetTasks
from tamer.tasks.trip_planner import TripPlannerConfig, TripPlannerTasks
from tamer.tasks.units import UnitsConfig, UnitsTasks


@dataclass(frozen=True)
class TaskConfig:
    """Which task: `arithmetic`, `calculator`, `code`, `trip_planner` (built in) or `dataset` (your files)."""

    name: str = "arithmetic"
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    trip_planner: TripPlannerConfig = field(default_factory=TripPlannerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    units: UnitsConfig = field(default_factory=UnitsConfig)  # the RLHF demo's task (hidden preference rule)

    def __post_init__(self) -> None:
        if self.name not in TASK_SOURCES:
            raise ValueError(f"task.name: unknown task {self.name!r}; valid: {', '.join(TASK_SOURCES.names())}")


def get_task_source(config: TaskConfig) -> TaskSource:
    """The task source a config names, built with its own section of the config."""
    cls = TASK_SOURCES.get(config.name)
    section = getattr(config, config.name, None)
    return cls(section) if section is not None else cls()


__all__ = [
    "ArithmeticConfig", "ArithmeticTasks", "CalculatorConfig", "CalculatorTasks", "CodeConfig", "CodeTasks",
    "TripPlannerConfig", "TripPlannerTasks", "UnitsConfig", "UnitsTasks", "DatasetConfig", "DatasetError", "DatasetTasks",
    "TASK_SOURCES", "Task", "TaskConfig", "TaskPool", "TaskSource", "extract_answer",
    "get_task_source", "is_correct",
]
