"""Built-in `scheduler` environment: a long-horizon task with per-turn (process) rewards.

An assistant books a queue of meeting requests into a calendar whose busy days it cannot
see. The prompt gives the rule and the first request; each booking answers with the next
request, so an episode is a long chain of small steps (two calls per meeting, 10 for the
default 5 meetings):

    Book 5 meetings in order: each on its day, or if busy the first free day after. First: day 7.
    check(day=7)   -> {"free":false,"first_free":9}
    book(day=9)    -> {"request":12}          (the next meeting asks for day 12)
    check(day=12)  -> {"free":true}
    book(day=12)   -> {"request":3}
    ...            -> {"done":true}           after the last booking; the episode ends

The calendar takes any booking, as shared calendars do: a double booking or a wrong day is
only found when the week is reviewed, i.e. in the outcome (`info["success"]`: every meeting
on its right day). The environment also knows each step's worth right away and gives it
as the step's process reward (`StepResult.reward`): +1 for a booking on the right day, -1
for a booking on a wrong one and -1 for a failed call, 0 otherwise. Outcome-only training
sees only the all-or-nothing verdict; `turn_grpo` credits each turn with the process
rewards earned from it on.

The scripted demonstrator is careless in one habitual way: for each meeting, with
`demo_hasty_rate`, it books the requested day without checking it (right only when that day
happens to be free); otherwise it checks and books the day the check points to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tamer.config import FieldError
from tamer.tasks.base import TASK_SOURCES, Task
from tamer.tasks.env import ENVIRONMENTS, StepResult
from tamer.tasks.tool_env import ToolEnvironment
from tamer.tasks.trip_planner import format_call
from tamer.tasks.trip_world import to_json
from tamer.tools.schema import ToolSet


@dataclass(frozen=True)
class SchedulerConfig:
    """Calendars, request queues and the demonstrator of the `scheduler` task."""

    meetings: int = 5  # requests per episode; the careful policy makes 2 calls per meeting
    max_day: int = 20  # days 1..max_day
    busy_days: int = 7  # hidden busy days per calendar
    busy_request_rate: float = 0.6  # chance a request asks for a day that is not free
    demo_hasty_rate: float = 0.7  # chance, per meeting, that the demonstrator books without checking
    heldout_size: int = 300  # calendars held out for evaluation
    train_size: int = 3000  # calendars to train on
    seed: int = 0  # calendar generation

    def __post_init__(self) -> None:
        if not 1 <= self.meetings <= 12:
            raise FieldError("meetings", f"expected 1..12, got {self.meetings}")
        if self.max_day < 2 * self.meetings + self.busy_days + 2:
            raise FieldError("max_day", f"{self.max_day} days cannot hold {self.busy_days} busy days "
                                        f"and {self.meetings} meetings with room after each")
        if self.busy_days < 1:
            raise FieldError("busy_days", f"expected at least 1, got {self.busy_days}")
        for name in ("busy_request_rate", "demo_hasty_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, f"expected a probability in [0, 1], got {getattr(self, name)}")
        for name in ("heldout_size", "train_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Week:
    """One calendar and its queue of requests; `answers` are the right days, in order."""

    busy: tuple[int, ...]  # hidden busy days, sorted
    requests: tuple[int, ...]  # the day each meeting asks for, in queue order
    answers: tuple[int, ...]  # the right day for each meeting
    max_day: int

    def to_dict(self) -> dict[str, Any]:
        return {"busy": list(self.busy), "requests": list(self.requests), "answers": list(self.answers),
                "max_day": self.max_day}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Week:
        return cls(tuple(data["busy"]), tuple(data["requests"]), tuple(data["answers"]), int(data["max_day"]))


def first_free(day: int, taken: set[int], max_day: int) -> int | None:
    """The first day from `day` on that is not taken, or None past the calendar's end."""
    return next((d for d in range(day, max_day + 1) if d not in taken), None)


def generate_week(rng: random.Random, config: SchedulerConfig) -> Week:
    """Busy days, then requests one by one: each asks for a taken day with `busy_request_rate`
    (busy, or booked by an earlier meeting) and always has a free day after it."""
    for _ in range(1000):
        busy = set(rng.sample(range(1, config.max_day + 1), config.busy_days))
        taken, requests, answers = set(busy), [], []
        for _ in range(config.meetings):
            want_taken = rng.random() < config.busy_request_rate
            options = [d for d in range(1, config.max_day + 1)
                       if (d in taken) == want_taken and first_free(d, taken, config.max_day) is not None]
            if not options:
                break
            request = rng.choice(options)
            answer = first_free(request, taken, config.max_day)
            requests.append(request)
            answers.append(answer)
            taken.add(answer)
        if len(requests) == config.meetings:
            return Week(tuple(sorted(busy)), tuple(requests), tuple(answers), config.max_day)
    raise RuntimeError(f"scheduler: no week in 1000 draws for {config}")


def task_prompt(week: Week) -> str:
    return (f"Book {len(week.requests)} meetings in order: each on its day, or if busy the first free day after. "
            f"First: day {week.requests[0]}.")


def demonstrator_calls(week: Week, rng: random.Random, hasty_rate: float) -> list[tuple[str, dict[str, Any]]]:
    """Per meeting: with `hasty_rate` book the requested day unchecked; else check it, then book
    the day the check points to."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for request, answer in zip(week.requests, week.answers):
        if rng.random() < hasty_rate:
            calls.append(("book", {"day": request}))
        else:
            calls += [("check", {"day": request}), ("book", {"day": answer})]
    return calls


@ENVIRONMENTS.register("scheduler")
class SchedulerEnv(ToolEnvironment):
    """One week per episode; per-turn process rewards in `StepResult.reward`, the outcome in `info`."""

    def build_tools(self) -> ToolSet:
        return ToolSet([self.check, self.book])

    def on_reset(self, task: Task) -> None:
        self.week = Week.from_dict(task.meta["week"])
        self.taken = set(self.week.busy)  # what the calendar shows: busy days and bookings so far
        self.booked: list[int] = []
        self.turn_reward = 0.0

    def check(self, day: int) -> dict[str, Any]:
        """Whether a day is free; if not, the first free day after it.

        Args:
            day: Day of the month, e.g. 7.
        """
        day = self._day(day)
        if day not in self.taken:
            return {"free": True}
        return {"free": False, "first_free": first_free(day, self.taken, self.week.max_day)}

    def book(self, day: int) -> dict[str, Any]:
        """Book the current meeting on a day; answers with the next meeting's requested day.

        Args:
            day: Day of the month, e.g. 9.
        """
        day = self._day(day)
        meeting = len(self.booked)
        self.turn_reward += 1.0 if day == self.week.answers[meeting] else -1.0
        self.booked.append(day)
        self.taken.add(day)
        if len(self.booked) == len(self.week.requests):
            return {"done": True}
        return {"request": self.week.requests[len(self.booked)]}

    def _day(self, day: Any) -> int:
        if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= self.week.max_day:
            raise ValueError(f"day must be a whole number 1-{self.week.max_day}")
        if len(self.booked) >= len(self.week.requests):
            raise ValueError("every meeting is booked")
        return day

    def step(self, action: str) -> StepResult:
        self.turn_reward = 0.0
        result = super().step(action)
        failed = sum(not call["ok"] for call in result.info.get("turn_calls", []))
        result.reward = self.turn_reward - failed
        result.info.update(self._score())
        if len(self.booked) == len(self.week.requests):  # the queue is done: the episode ends
            result.done = True
        return result

    def finish(self, final_text: str) -> dict[str, Any]:
        return self._score()

    def _score(self) -> dict[str, Any]:
        right = sum(b == a for b, a in zip(self.booked, self.week.answers))
        return {"success": right == len(self.week.answers), "right_bookings": right,
                "bookings": len(self.booked), "meetings": len(self.week.answers)}


@TASK_SOURCES.register("scheduler")
class SchedulerTasks:
    """Weeks to schedule; each task carries its week in `meta`."""

    name = "scheduler"

    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config

    def split(self) -> tuple[list[Task], list[Task]]:
        """Disjoint (train, held-out) weeks; week i comes from its own seeded RNG."""
        tasks: dict[str, Task] = {}
        index = 0
        while len(tasks) < self.config.heldout_size + self.config.train_size:
            week = generate_week(random.Random(f"scheduler:{self.config.seed}:{index}"), self.config)
            index += 1
            key = to_json(week.to_dict())
            if key not in tasks:
                tasks[key] = Task(id=f"week-{index}", messages=({"role": "user", "content": task_prompt(week)},),
                                  answer="", meta={"week": week.to_dict()}, env="scheduler")
        ordered = list(tasks.values())
        return ordered[self.config.heldout_size:], ordered[: self.config.heldout_size]

    def demonstrate_turns(self, task: Task, rng: random.Random) -> list[str]:
        week = Week.from_dict(task.meta["week"])
        return [format_call(name, args) for name, args in demonstrator_calls(week, rng, self.config.demo_hasty_rate)]

    def demonstrate(self, task: Task, rng: random.Random) -> str:
        return "".join(self.demonstrate_turns(task, rng))
