"""The `scheduler` environment: weeks, the per-turn (process) rewards, the outcome, the demonstrator."""

from __future__ import annotations

import random

import pytest

from tamer.config import ConfigError, load_config
from tamer.pipeline import RunConfig
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.tasks import SchedulerConfig, SchedulerTasks, TaskConfig, get_task_source
from tamer.tasks.env import ENVIRONMENTS
from tamer.tasks.scheduler import Week, demonstrator_calls, first_free, generate_week
from tamer.tasks.trip_planner import format_call

CONFIG = SchedulerConfig(heldout_size=100, train_size=100)


@pytest.fixture(scope="module")
def split():
    return SchedulerTasks(CONFIG).split()


def test_weeks_are_consistent_and_busy_requests_about_as_configured():
    rng, busy_requests, total = random.Random(0), 0, 0
    for _ in range(300):
        week = generate_week(rng, CONFIG)
        taken = set(week.busy)
        assert len(week.busy) == CONFIG.busy_days and len(week.requests) == CONFIG.meetings
        for request, answer in zip(week.requests, week.answers):
            busy_requests += request in taken
            total += 1
            assert answer == first_free(request, taken, week.max_day) and answer not in taken
            taken.add(answer)
    assert 0.5 < busy_requests / total < 0.7  # busy_request_rate 0.6


def test_split_is_disjoint_and_deterministic(split):
    train, heldout = split
    assert len(train) == 100 and len(heldout) == 100
    assert not {t.id for t in train} & {t.id for t in heldout}
    keys = lambda tasks: [str(t.meta["week"]) for t in tasks]  # noqa: E731
    assert not set(keys(train)) & set(keys(heldout))
    assert keys(SchedulerTasks(CONFIG).split()[1]) == keys(heldout)
    assert heldout[0].messages[0]["content"].startswith("Book 5 meetings in order")


def _env(task):
    env = ENVIRONMENTS.get("scheduler")()
    env.reset(task)
    return env


def test_careful_episode_earns_a_process_reward_per_booking_and_succeeds(split):
    task = split[1][0]
    week = Week.from_dict(task.meta["week"])
    env = _env(task)
    rewards, observations = [], []
    for name, args in demonstrator_calls(week, random.Random(0), hasty_rate=0.0):
        result = env.step(format_call(name, args))
        rewards.append(result.reward)
        observations.append(result.observation)
    assert rewards == [0.0, 1.0] * CONFIG.meetings
    assert result.done and result.info["success"] and result.info["right_bookings"] == CONFIG.meetings
    assert result.info["tool_calls"] == 2 * CONFIG.meetings >= 10
    first = week.requests[0]
    if week.answers[0] == first:
        assert observations[0] == '<tool_response>{"free":true}</tool_response>'
    else:
        assert observations[0] == f'<tool_response>{{"free":false,"first_free":{week.answers[0]}}}</tool_response>'
    assert observations[1] == f'<tool_response>{{"request":{week.requests[1]}}}</tool_response>'


def test_unchecked_busy_booking_is_silent_but_scored(split):
    """The calendar takes a double booking (the agent sees the next request as usual); the
    process reward is -1 at once, and the outcome fails."""
    task = next(t for t in split[1] if t.meta["week"]["requests"][0] != t.meta["week"]["answers"][0])
    env = _env(task)
    request = task.meta["week"]["requests"][0]
    result = env.step(format_call("book", {"day": request}))
    assert result.reward == -1.0 and '"request"' in result.observation and not result.done
    assert result.info["success"] is False and result.info["right_bookings"] == 0


def test_failed_calls_cost_a_point_and_do_not_book(split):
    env = _env(split[1][0])
    for bad in ('<tool_call>{"name":"book","arguments":{"day":99}}</tool_call>',
                '<tool_call>{"name":"book","arguments":{"day":"7"}}</tool_call>',
                '<tool_call>{"name":"cancel","arguments":{"day":7}}</tool_call>',
                '<tool_call>{"name":"check"</tool_call>'):
        result = env.step(bad)
        assert result.reward == -1.0 and "error" in result.observation and not result.done
    assert env.booked == [] and result.info["tool_calls"] == 4


def test_an_answer_without_calls_ends_the_episode_unsuccessfully(split):
    result = _env(split[1][0]).step("<answer>done</answer>")
    assert result.done and result.info["success"] is False and result.reward == 0.0


def test_demonstrator_habit_and_replay_through_the_agent_loop(split, tokenizer):
    source = SchedulerTasks(CONFIG)
    rng = random.Random(0)
    replayer = AgentRollout(None, tokenizer, AgentConfig(max_turns=14, max_total_tokens=4000, show_tools=False))
    hasty = meetings = successes = 0
    for task in split[0][:100]:
        turns = source.demonstrate_turns(task, rng)
        traj = replayer.replay(task, turns)
        meetings += CONFIG.meetings
        hasty += CONFIG.meetings - sum('"check"' in t for t in turns)
        successes += traj.info["success"]
        week = Week.from_dict(task.meta["week"])
        right = [r == a for r, a in zip(week.requests, week.answers)]
        assert traj.info["bookings"] == CONFIG.meetings and len(traj.turns) == len(turns)
        assert sum(t.env_reward for t in traj.turns) == 2 * traj.info["right_bookings"] - CONFIG.meetings
        assert traj.info["right_bookings"] >= sum(right)  # checked meetings are always right
    assert 0.6 < hasty / meetings < 0.8  # demo_hasty_rate 0.7
    assert successes < 20  # a careless demonstrator: most weeks end with a wrong booking


@pytest.mark.parametrize("override, message", [
    ("task.scheduler.meetings=0", "task.scheduler.meetings"),
    ("task.scheduler.max_day=10", "task.scheduler.max_day"),
    ("task.scheduler.demo_hasty_rate=1.5", "task.scheduler.demo_hasty_rate"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, overrides=["task.name=scheduler", override])


def test_registered_as_a_task():
    assert isinstance(get_task_source(TaskConfig(name="scheduler")), SchedulerTasks)
