"""Tests for the trip_planner world: generation, the checked best plan, the tools, the demonstrator."""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import replace

import pytest

from tamer.tasks.trip_world import (
    MIN_TOOL_CALLS,
    TOOL_NAMES,
    Flight,
    Hotel,
    TripTools,
    TripWorldConfig,
    World,
    demonstrator_calls,
    generate_world,
    min_tool_calls,
    optimal_plan,
    replay,
    score_booking,
    split,
    task_prompt,
    to_json,
    world_id,
)

CONFIG = TripWorldConfig(train_size=200, heldout_size=300)


@pytest.fixture(scope="module")
def worlds() -> list[World]:
    return split(CONFIG)[1]


def perfect_calls(world: World) -> list[tuple[str, dict]]:
    flight, hotel, _ = optimal_plan(world)
    checks = [("check_calendar", {"flight": f.id}) for f in world.by_price()[: world.first_free() + 1]]
    return [("search_flights", {"origin": world.origin, "dest": world.destination}),
            ("search_hotels", {"city": world.destination, "nights": world.nights}),
            *checks, ("book", {"flight": flight, "hotel": hotel})]


def ready_tools(world: World) -> TripTools:
    """Tools after both searches and a check of every flight: only `book` is left to test."""
    tools = TripTools(world)
    tools.search_flights(world.origin, world.destination)
    tools.search_hotels(world.destination, world.nights)
    for f in world.flights:
        tools.check_calendar(f.id)
    return tools


# --- config and generation -----------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("n_flights", 5), ("min_nights", 0), ("window", 1),
                                          ("trap_rate", 1.5), ("budget_slack", (0.5, 0.1)), ("max_day", 5)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TripWorldConfig(**{field: value})


def test_generation_is_deterministic_for_a_seed():
    a = [generate_world(random.Random(7), CONFIG) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    assert split(CONFIG) == split(CONFIG)


def test_worlds_are_well_formed(worlds):
    for w in worlds:
        assert w.origin != w.destination and len(w.origin) == len(w.destination) == 3
        assert [f.id for f in w.flights] == [f"F{i + 1}" for i in range(CONFIG.n_flights)]
        assert [h.id for h in w.hotels] == [f"H{i + 1}" for i in range(CONFIG.n_hotels)]
        assert all(w.first_day <= f.day <= w.last_day for f in w.flights)
        assert w.first_day >= 1 and w.last_day + w.nights <= w.max_day
        assert CONFIG.min_nights <= w.nights <= CONFIG.max_nights
        assert len(w.busy) == CONFIG.n_busy and list(w.busy) == sorted(w.busy)
        assert w.budget >= optimal_plan(w)[2]
        assert World.from_dict(w.to_dict()) == w


def test_cheapest_flight_is_a_trap_about_as_often_as_configured(worlds):
    traps = [bool(w.conflicts(min(w.flights, key=lambda f: f.price))) for w in worlds]
    assert 0.35 < statistics.mean(traps) < 0.65


def test_optimal_plan_matches_brute_force_and_is_unique(worlds):
    for w in worlds:
        costs = {}
        for f, h in itertools.product(w.flights, w.hotels):
            free = all(not (f.day <= b <= f.day + w.nights) for b in w.busy)
            cost = f.price + w.nights * h.night
            if free and cost <= w.budget:
                costs[(f.id, h.id)] = cost
        best = min(costs.values())
        assert [k for k, c in costs.items() if c == best] == [optimal_plan(w)[:2]]
        assert optimal_plan(w)[2] == best


def test_split_is_disjoint_and_held_out_is_stable():
    train, heldout = split(CONFIG)
    assert len(heldout) == 300 and len(train) == 200
    assert len(set(train) | set(heldout)) == 500
    assert split(replace(CONFIG, train_size=50))[1] == heldout
    assert split(replace(CONFIG, seed=1))[1] != heldout
    assert TripWorldConfig().heldout_size >= 300
    assert len({world_id(w) for w in heldout}) == 300


def test_prompt_is_short_and_hides_the_calendar(worlds):
    w = worlds[0]
    prompt = task_prompt(w)
    assert prompt.startswith(f"Trip {w.origin}>{w.destination}, leave day {w.first_day}-{w.last_day}, ")
    assert f"budget {w.budget}" in prompt and "busy" not in prompt and len(prompt) < 90


# --- the tools -----------------------------------------------------------------------------------


WORLD = World("LON", "ROM", 4, 6, 3,
              flights=(Flight("F1", 4, 150), Flight("F2", 6, 200), Flight("F3", 5, 300)),
              hotels=(Hotel("H1", 100), Hotel("H2", 80), Hotel("H3", 120)),
              busy=(5, 13), budget=500)
# F1 (days 4-7) and F3 (5-8) hit day 5; F2 (6-9) is free: F2+H2 = 200 + 3*80 = 440 is best,
# F2+H1 = 500 fits the budget exactly, F2+H3 = 560 does not.


def test_hand_built_world_plans():
    assert optimal_plan(WORLD) == ("F2", "H2", 440)
    tools = TripTools(WORLD)
    assert tools.search_flights("lon", "ROM") == [{"id": "F1", "day": 4, "price": 150},
                                                  {"id": "F2", "day": 6, "price": 200},
                                                  {"id": "F3", "day": 5, "price": 300}]  # cheapest first
    assert tools.search_hotels("ROM", 3) == [{"id": "H2", "price": 240}, {"id": "H1", "price": 300},
                                             {"id": "H3", "price": 360}]  # cheapest first
    assert tools.check_calendar("F1") == {"busy": [5]}
    assert tools.check_calendar("f2") == {"busy": []}
    with pytest.raises(ValueError, match="unknown flight F7"):
        tools.check_calendar("F7")
    assert tools.book("F2", "H2") == {"booked": "F2,H2", "cost": 440}
    score = score_booking(WORLD, tools)
    assert min_tool_calls(WORLD) == 5  # F1 is cheapest but busy: it must be checked too
    assert score == {"success": True, "cost": 440.0, "optimal_cost": 440.0, "cost_ratio": 1.0,
                     "optimal": True, "tool_calls": 6, "extra_calls": 1, "errors": 1}  # the F7 check


@pytest.mark.parametrize("flight, hotel, message", [
    ("F1", "H2", "day 5 busy"),
    ("F2", "H3", "cost 560 over budget 500"),
    ("F9", "H2", "unknown flight F9"),
    ("F2", "H7", "unknown hotel H7"),
])
def test_book_rejects_invalid_plans_with_clear_errors(flight, hotel, message):
    tools = ready_tools(WORLD)
    with pytest.raises(ValueError, match=message):
        tools.book(flight, hotel)
    assert tools.errors == 1 and tools.booking is None
    assert tools.book("F2", "H1") == {"booked": "F2,H1", "cost": 500}  # a failed call does not block
    with pytest.raises(ValueError, match="already booked"):
        tools.book("F2", "H2")
    score = score_booking(WORLD, tools)
    assert score["success"] and score["cost_ratio"] == pytest.approx(500 / 440) and not score["optimal"]
    assert (score["tool_calls"], score["errors"]) == (8, 2)


def test_book_requires_searches_and_a_calendar_check():
    tools = TripTools(WORLD)
    with pytest.raises(ValueError, match="search flights first"):
        tools.book("F2", "H2")
    tools.search_flights("LON", "ROM")
    with pytest.raises(ValueError, match="search hotels first"):
        tools.book("F2", "H2")
    tools.search_hotels("ROM", 3)
    tools.check_calendar("F1")  # not the flight that is booked
    with pytest.raises(ValueError, match="check calendar for F2 first"):
        tools.book("F2", "H2")
    assert score_booking(WORLD, tools)["success"] is False
    assert score_booking(WORLD, tools)["cost_ratio"] is None


@pytest.mark.parametrize("name, arguments, message", [
    ("search_flights", {"origin": "ROM", "dest": "LON"}, "no flights ROM>LON"),
    ("search_hotels", {"city": "ROM", "nights": 0}, "nights must be 1-14"),
    ("search_hotels", {"city": "LON", "nights": 3}, "no hotels in LON"),
    ("check_calendar", {"flight": "F2"}, "search flights first"),
    ("fly", {}, "unknown tool fly"),
])
def test_bad_calls_raise_and_are_counted(name, arguments, message):
    tools = TripTools(WORLD)
    with pytest.raises(ValueError, match=message):
        tools.call(name, arguments)
    assert (len(tools.calls), tools.errors) == (1, 1)


def test_wrong_arguments_count_as_errors():
    tools, observations = replay(WORLD, [("book", {"flight_id": "F2"})])
    assert observations[0].startswith("error: ") and tools.errors == 1


def test_tools_make_json_schemas():
    from tamer.tools.schema import Tool

    tools = [Tool.from_function(fn) for fn in TripTools(WORLD).functions()]
    assert tuple(t.name for t in tools) == TOOL_NAMES
    assert list(tools[2].parameters["properties"]) == ["flight"]
    assert tools[3].parameters["required"] == ["flight", "hotel"]


# --- episodes: perfect agent and demonstrator -----------------------------------------------------


def test_a_perfect_agent_needs_exactly_min_tool_calls(worlds):
    for w in worlds:
        tools, _ = replay(w, perfect_calls(w))
        score = score_booking(w, tools)
        assert score["optimal"] and score["tool_calls"] == min_tool_calls(w) >= MIN_TOOL_CALLS
        assert score["errors"] == 0 and score["extra_calls"] == 0


def test_demonstrator_always_books_but_wastes(worlds):
    rng = random.Random(0)
    scores = []
    for w in worlds[:200]:
        calls = demonstrator_calls(w, rng)
        assert calls[-1][0] == "book" and sum(name == "book" for name, _ in calls) == 1
        tools, observations = replay(w, calls)
        scores.append(score_booking(w, tools))
        assert scores[-1]["success"] and scores[-1]["errors"] == 0, observations
    assert statistics.mean(s["cost_ratio"] for s in scores) > 1.0
    assert any(s["optimal"] for s in scores) and not all(s["optimal"] for s in scores)
    assert statistics.mean(s["tool_calls"] for s in scores) > statistics.mean(map(min_tool_calls, worlds[:200]))
    assert min(s["tool_calls"] for s in scores) == MIN_TOOL_CALLS


def test_searches_list_cheapest_first(worlds):
    for w in worlds[:50]:
        tools = TripTools(w)
        flights = tools.search_flights(w.origin, w.destination)
        hotels = tools.search_hotels(w.destination, w.nights)
        assert [f["price"] for f in flights] == sorted(f.price for f in w.flights)
        assert [h["price"] for h in hotels] == sorted(h.night * w.nights for h in w.hotels)
        # the best plan: the first listed flight whose days are free, with the first listed hotel
        free = next(f for f in flights if not any(f["day"] <= d <= f["day"] + w.nights for d in w.busy))
        assert optimal_plan(w)[:2] == (free["id"], hotels[0]["id"])


def test_demonstrator_without_waste_checks_cheapest_first(worlds):
    rng = random.Random(0)
    for w in worlds[:50]:
        calls = demonstrator_calls(w, rng, waste_rate=0.0, pricier_rate=0.0)
        tools, _ = replay(w, calls)
        score = score_booking(w, tools)
        assert score["optimal"] and score["errors"] == 0 and len(calls) == min_tool_calls(w)
        checks = [args for name, args in calls if name == "check_calendar"]
        assert [c["flight"] for c in checks] == [f.id for f in w.by_price()[: len(checks)]]


def episode_text(world: World, calls: list[tuple[str, dict]], observations: list[str]) -> str:
    turns = (to_json({"name": name, "arguments": args}) + obs for (name, args), obs in zip(calls, observations))
    return task_prompt(world) + "".join(turns)


def test_demonstrator_episodes_are_short(worlds):
    rng = random.Random(0)
    lengths = []
    for w in worlds[:200]:
        calls = demonstrator_calls(w, rng)
        lengths.append(len(episode_text(w, calls, replay(w, calls)[1])))
    perfect = statistics.mean(len(episode_text(w, c, replay(w, c)[1])) for w in worlds[:200]
                              for c in [perfect_calls(w)])
    print(f"\nepisode chars: demonstrator mean {statistics.mean(lengths):.0f} max {max(lengths)}, "
          f"perfect mean {perfect:.0f}")
    assert statistics.mean(lengths) < 850 and perfect < 640


def test_hasty_demonstrator_recovers_from_a_busy_day(worlds):
    """hasty_rate=1: in trap worlds one failed `book` ("day N busy"), then a valid booking."""
    rng, traps = random.Random(0), 0
    for w in worlds[:100]:
        calls = demonstrator_calls(w, rng, waste_rate=0.0, pricier_rate=0.0, hasty_rate=1.0)
        tools, observations = replay(w, calls)
        score = score_booking(w, tools)
        assert score["success"] and score["optimal"]
        trap = bool(w.conflicts(w.by_price()[0]))
        traps += trap
        assert score["errors"] == int(trap) and len(calls) == min_tool_calls(w) + int(trap)
        if trap:
            assert "busy" in observations[-2] and calls[-2][0] == "book"
    assert 20 < traps < 80


def test_ids_follow_the_listed_order_only_when_asked():
    ordered = [generate_world(random.Random(i), CONFIG) for i in range(40)]
    shuffled = [generate_world(random.Random(i), replace(CONFIG, ordered_ids=False)) for i in range(40)]
    assert all([f.id for f in w.by_price()] == ["F1", "F2", "F3"] for w in ordered)
    assert all(min(w.hotels, key=lambda h: h.night).id == "H1" for w in ordered)
    assert not all([f.id for f in w.by_price()] == ["F1", "F2", "F3"] for w in shuffled)


def test_habitual_demonstrator_checks_every_flight(worlds):
    """check_all_rate: in that share of episodes every flight is checked, whatever was free;
    the rest check up to the first free flight. Bookings stay valid and optimal."""
    rng, habitual = random.Random(0), 0
    for w in worlds[:200]:
        calls = demonstrator_calls(w, rng, waste_rate=0.0, pricier_rate=0.0, check_all_rate=0.8)
        tools, _ = replay(w, calls)
        score = score_booking(w, tools)
        assert score["success"] and score["optimal"] and score["errors"] == 0
        checks = [args["flight"] for name, args in calls if name == "check_calendar"]
        assert checks in ([f.id for f in w.by_price()], [f.id for f in w.by_price()[: w.first_free() + 1]])
        habitual += len(calls) == 2 + len(w.flights) + 1 and w.first_free() + 1 < len(w.flights)
    could_stop_early = sum(w.first_free() + 1 < len(w.flights) for w in worlds[:200])
    assert 0.7 < habitual / could_stop_early < 0.9
    always = [demonstrator_calls(w, rng, waste_rate=0.0, pricier_rate=0.0, check_all_rate=1.0) for w in worlds[:50]]
    assert all(len(c) == 6 for c in always)  # 2 searches, 3 checks, the booking


def test_check_all_rate_zero_leaves_the_demonstrator_unchanged(worlds):
    for seed in range(3):
        a = [demonstrator_calls(w, random.Random(seed)) for w in worlds[:50]]
        b = [demonstrator_calls(w, random.Random(seed), check_all_rate=0.0) for w in worlds[:50]]
        assert a == b
