"""Task sources: built-in generators and the user's own datasets, chosen by name.

The `code` task and its sandboxed `python` environment are registered lazily: their module
(and the sandbox it needs) is imported only when a run names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tamer.config import FieldError, check_name
from tamer.tasks.arithmetic import ArithmeticConfig, ArithmeticTasks
from tamer.tasks.base import TASK_SOURCES, Task, TaskPool, TaskSource, extract_answer, is_correct
from tamer.tasks.calculator import CalculatorConfig, CalculatorTasks
from tamer.tasks.code_config import CodeConfig
from tamer.tasks.dataset import DatasetConfig, DatasetError, DatasetTasks
from tamer.tasks.env import ENVIRONMENTS
from tamer.tasks.scheduler import SchedulerConfig, SchedulerTasks
from tamer.tasks.trip_planner import TripPlannerConfig, TripPlannerTasks
from tamer.tasks.units import UnitsConfig, UnitsTasks

TASK_SOURCES.register_lazy("code", "tamer.tasks.code:CodeTasks")
ENVIRONMENTS.register_lazy("python", "tamer.tasks.code:PythonEnv")


@dataclass(frozen=True)
class TaskConfig:
    """Which task: `arithmetic`, `calculator`, `code`, `trip_planner`, `scheduler` (built in) or `dataset`
    (your files)."""

    name: str = "arithmetic"  # a registered task source (built in, or registered by a plugin)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)  # used when name = arithmetic
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)  # used when name = calculator
    code: CodeConfig = field(default_factory=CodeConfig)  # used when name = code
    trip_planner: TripPlannerConfig = field(default_factory=TripPlannerConfig)  # used when name = trip_planner
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # used when name = scheduler
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # used when name = dataset
    units: UnitsConfig = field(default_factory=UnitsConfig)  # used when name = units (the RLHF demo's task)

    def __post_init__(self) -> None:
        check_name("name", self.name, TASK_SOURCES.names(), "task")
        if self.name == "dataset" and not self.dataset.path:
            raise FieldError("dataset.path", "give the path of a JSONL, JSON or Parquet file")


def get_task_source(config: TaskConfig) -> TaskSource:
    """The task source a config names, built with its own section of the config."""
    cls = TASK_SOURCES.get(config.name)
    section = getattr(config, config.name, None)
    return cls(section) if section is not None else cls()


__all__ = [
    "ArithmeticConfig", "ArithmeticTasks", "CalculatorConfig", "CalculatorTasks", "CodeConfig",
    "TripPlannerConfig", "TripPlannerTasks", "SchedulerConfig", "SchedulerTasks", "UnitsConfig", "UnitsTasks",
    "DatasetConfig", "DatasetError", "DatasetTasks",
    "TASK_SOURCES", "Task", "TaskConfig", "TaskPool", "TaskSource", "extract_answer",
    "get_task_source", "is_correct",
]
