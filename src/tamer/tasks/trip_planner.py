"""Built-in `trip_planner` environment: book the cheapest valid trip with simulated tools.

The agent sees a request ("Trip LON>MAD, leave day 1-3, 4 nights, budget 850. Book the
cheapest valid trip.") and four tools: `search_flights`, `search_hotels`,
`check_calendar`, `book` (see `trip_world`). The episode ends when a booking succeeds or
the agent stops calling tools. The verifiable best plan is known for every world, so the
outcome is scored as: valid booking made, cost over the optimum, tool calls, errors.

The scripted demonstrator is correct but wasteful: it checks the flights' days one by one,
cheapest first, until one is free, and at times repeats a search or a check, checks every
flight, or books a valid but pricier plan; with `demo_hasty_rate` it sometimes first tries
the cheapest flight though it hits a busy day. With `demo_check_all_rate` above one half its
waste is a habit instead (it checks every flight before it books), which SFT copies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tamer.config import FieldError
from tamer.tasks.base import TASK_SOURCES, Task
from tamer.tasks.env import ENVIRONMENTS, StepResult
from tamer.tasks.tool_env import ToolEnvConfig, ToolEnvironment
from tamer.tasks.trip_world import (
    TripTools,
    TripWorldConfig,
    World,
    demonstrator_calls,
    generate_world,
    score_booking,
    split,
    task_prompt,
    to_json,
    world_id,
)
from tamer.tools.schema import ToolSet


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """One tool call in the Hermes format, compact JSON (what demonstrations and agents write)."""
    return "<tool_call>" + to_json({"name": name, "arguments": arguments}) + "</tool_call>"


@ENVIRONMENTS.register("trip_planner")
class TripPlannerEnv(ToolEnvironment):
    """One world per episode; `info` carries the booking score after every step."""

    def __init__(self, config: ToolEnvConfig | None = None) -> None:
        self.trip: TripTools | None = None
        super().__init__(config)

    def build_tools(self) -> ToolSet:
        # Schemas come from the TripTools methods' signatures and docstrings (any world will do).
        return ToolSet(TripTools(_SCHEMA_WORLD).functions())

    def on_reset(self, task: Task) -> None:
        self.world = World.from_dict(task.meta["world"])
        self.trip = TripTools(self.world)
        self.toolset = ToolSet(self.trip.functions())

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        result.info.update(score_booking(self.world, self.trip))
        if self.trip.booking is not None:  # a successful booking is the end of the job
            result.done = True
        return result

    def finish(self, final_text: str) -> dict[str, Any]:
        return score_booking(self.world, self.trip)


@dataclass(frozen=True)
class TripPlannerConfig:
    """Worlds and the demonstrator of the `trip_planner` task."""

    world: TripWorldConfig = field(default_factory=TripWorldConfig)  # how worlds are generated
    demo_waste_rate: float = 0.5  # chance of redundant calls
    demo_pricier_rate: float = 0.3  # chance of booking a valid but pricier plan
    demo_hasty_rate: float = 0.0  # chance of first trying the cheapest flight when it hits a busy day
    demo_check_all_rate: float = 0.0  # chance of checking every flight first (> 0.5: a habit SFT copies)

    def __post_init__(self) -> None:
        for name in ("demo_waste_rate", "demo_pricier_rate", "demo_hasty_rate", "demo_check_all_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, f"expected a probability in [0, 1], got {getattr(self, name)}")


@TASK_SOURCES.register("trip_planner")
class TripPlannerTasks:
    """Tasks for the trip planner; each carries its world in `meta`."""

    name = "trip_planner"

    def __init__(self, config: TripPlannerConfig = TripPlannerConfig()) -> None:
        self.config = config

    @staticmethod
    def _task(world: World) -> Task:
        return Task(id=world_id(world), messages=({"role": "user", "content": task_prompt(world)},),
                    answer="", meta={"world": world.to_dict()}, env="trip_planner")

    def split(self) -> tuple[list[Task], list[Task]]:
        train, heldout = split(self.config.world)
        return [self._task(w) for w in train], [self._task(w) for w in heldout]

    def demonstrate_turns(self, task: Task, rng: random.Random) -> list[str]:
        calls = demonstrator_calls(World.from_dict(task.meta["world"]), rng,
                                   waste_rate=self.config.demo_waste_rate, pricier_rate=self.config.demo_pricier_rate,
                                   hasty_rate=self.config.demo_hasty_rate,
                                   check_all_rate=self.config.demo_check_all_rate)
        return [format_call(name, args) for name, args in calls]

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        return "".join(self.demonstrate_turns(task, rng))


_SCHEMA_WORLD = generate_world(random.Random(0))
