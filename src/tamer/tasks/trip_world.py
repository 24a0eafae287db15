"""The world of the `trip_planner` environment: generated trips, simulated tools, a checked best plan.

A world is one small trip to plan: fly `origin>destination` on one of a few days, stay
`nights` nights, without hitting a day the traveller is busy, within a budget. The agent
sees only the prompt and learns the rest by calling tools:

    world = generate_world(random.Random(0), TripWorldConfig())
    task_prompt(world)   # 'Trip LON>ROM, leave day 4-6, 3 nights, budget 900. Book the cheapest valid trip.'
    tools = TripTools(world)
    tools.search_flights("LON", "ROM")   # [{"id":"F1","day":5,"price":210}, {"id":"F2","day":4,"price":250}, ...]
    tools.search_hotels("ROM", 3)        # [{"id":"H1","price":240}, ...] (all nights), cheapest first
    tools.check_calendar("F1")           # {"busy":[5]}: the trip on F1 hits busy day 5
    tools.check_calendar("F2")           # {"busy":[]}: free
    tools.book("F2", "H1")               # {"booked":"F2,H1","cost":490}, or ValueError
    score_booking(world, tools)          # success, cost, optimal_cost, cost_ratio, tool_calls, errors

A trip on a flight occupies its day through `nights` days later (the day home), inclusive;
a busy day anywhere in that range is a conflict. The calendar is not in the prompt:
`check_calendar(flight)` shows the busy days of the trip on one flight, and `book`
refuses a flight that was not checked. Searches list results cheapest first, as booking
sites do, so the best plan is the first listed flight whose trip is free with the first
listed hotel, and the fewest calls that find it and know it is best are both searches,
a check of every flight up to that one, and the booking (`min_tool_calls`). Every text
is short and regular (3-letter cities, days 1..14, ids F1.., H1..) because the agents
are tiny models. Worlds are generated so that exactly one valid plan is cheapest
(`optimal_plan`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from tamer.config import FieldError

CITIES = ("AMS", "ATH", "BER", "DUB", "LIS", "LON", "MAD", "OSL", "PAR", "PRG", "ROM", "VIE")
TOOL_NAMES = ("search_flights", "search_hotels", "check_calendar", "book")
MIN_TOOL_CALLS = 4  # search flights, search hotels, check the booked flight, book: each is required once
FLIGHT_PRICES = range(80, 400, 10)  # whole tens keep the numbers (and the sums) short
HOTEL_NIGHT_PRICES = range(40, 160, 10)


@dataclass(frozen=True)
class TripWorldConfig:
    """How worlds are generated, and how many go to the train and held-out splits."""

    n_flights: int = 3  # options per flight search (ids F1..Fn)
    n_hotels: int = 3  # options per hotel search (ids H1..Hn)
    max_day: int = 14  # days are 1..max_day; the whole trip fits inside
    min_nights: int = 2  # shortest stay
    max_nights: int = 4  # longest stay
    window: int = 3  # departure window in days ("leave day 4-6")
    n_busy: int = 2  # busy calendar days; the first always falls where it can conflict
    trap_rate: float = 0.5  # share of worlds whose cheapest flight conflicts with the calendar
    # Ids number the results in the order a search lists them (F1 the cheapest flight, H1 the
    # cheapest hotel), as result pages number their options; with False they are drawn
    # independently of price, so an agent must find and copy the id of the entry it chose
    # (what that costs a 1M model: docs/demos.md).
    ordered_ids: bool = True  # ids in listed (price) order; False: drawn independently of price
    budget_slack: tuple[float, float] = (0.2, 0.6)  # budget = optimal cost * (1 + U(lo, hi))
    heldout_size: int = 300  # worlds held out for evaluation
    train_size: int = 3000  # training worlds
    seed: int = 0  # world generation

    def __post_init__(self) -> None:
        for name in ("n_flights", "n_hotels"):
            if not 2 <= getattr(self, name) <= 4:
                raise FieldError(name, f"expected 2..4 (short results), got {getattr(self, name)}")
        if not 1 <= self.min_nights <= self.max_nights:
            raise FieldError("min_nights", f"expected 1..max_nights, got {self.min_nights}")
        if self.window < 2:  # with one departure day every flight shares the calendar's fate
            raise FieldError("window", f"expected at least 2 days, got {self.window}")
        if self.window + self.max_nights > self.max_day:
            raise FieldError("max_day", f"{self.max_day} cannot hold a {self.window}-day window plus "
                                        f"{self.max_nights} nights")
        if not 1 <= self.n_busy <= self.max_day:
            raise FieldError("n_busy", f"expected 1..max_day, got {self.n_busy}")
        if not 0.0 <= self.trap_rate <= 1.0:
            raise FieldError("trap_rate", f"expected a probability in [0, 1], got {self.trap_rate}")
        if len(self.budget_slack) != 2 or not 0.0 <= self.budget_slack[0] <= self.budget_slack[1]:
            raise FieldError("budget_slack", f"expected [lo, hi] with 0 <= lo <= hi, got {self.budget_slack}")
        for name in ("heldout_size", "train_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Flight:
    id: str  # "F1"..
    day: int  # departure day
    price: int


@dataclass(frozen=True)
class Hotel:
    id: str  # "H1"..
    night: int  # price per night; the search shows the total for the asked nights


@dataclass(frozen=True)
class World:
    """One trip to plan. Hashable, so splits can check worlds for duplicates."""

    origin: str
    destination: str
    first_day: int  # departure window first_day..last_day
    last_day: int
    nights: int
    flights: tuple[Flight, ...]
    hotels: tuple[Hotel, ...]
    busy: tuple[int, ...]  # sorted busy days; never shown in the prompt
    budget: int
    max_day: int = 14  # the calendar's last day

    def stay(self, flight: Flight) -> range:
        """The days a trip on this flight occupies: out day through back day."""
        return range(flight.day, flight.day + self.nights + 1)

    def by_price(self) -> list[Flight]:
        """The flights as a search lists them: cheapest first."""
        return sorted(self.flights, key=lambda f: f.price)

    def first_free(self) -> int:
        """Index in `by_price()` of the cheapest flight whose trip hits no busy day."""
        return next(i for i, f in enumerate(self.by_price()) if not self.conflicts(f))

    def conflicts(self, flight: Flight) -> list[int]:
        return [d for d in self.stay(flight) if d in self.busy]

    def cost(self, flight: Flight, hotel: Hotel) -> int:
        return flight.price + self.nights * hotel.night

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, e.g. for `Task.meta`; `World.from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> World:
        return cls(**{**data, "flights": tuple(Flight(**f) for f in data["flights"]),
                      "hotels": tuple(Hotel(**h) for h in data["hotels"]), "busy": tuple(data["busy"])})


def to_json(obj: Any) -> str:
    """Compact JSON, no spaces: every character costs a tiny model context."""
    return json.dumps(obj, separators=(",", ":"))


# --- generation --------------------------------------------------------------------------------


def valid_plans(world: World) -> list[tuple[str, str, int]]:
    """Every (flight_id, hotel_id, cost) with no busy day in the stay and cost within budget, cheapest first."""
    plans = [(f.id, h.id, world.cost(f, h)) for f in world.flights for h in world.hotels
             if not world.conflicts(f) and world.cost(f, h) <= world.budget]
    return sorted(plans, key=lambda p: (p[2], p[0], p[1]))


def optimal_plan(world: World) -> tuple[str, str, int]:
    """The cheapest valid plan (exhaustive search; generated worlds guarantee it exists and is unique)."""
    plans = valid_plans(world)
    if not plans:
        raise ValueError("world has no valid plan")
    return plans[0]


def _draw_world(rng: random.Random, config: TripWorldConfig) -> World:
    origin, destination = rng.sample(CITIES, 2)
    nights = rng.randint(config.min_nights, config.max_nights)
    first = rng.randint(1, config.max_day - config.window - nights + 1)
    last = first + config.window - 1
    prices = rng.sample(FLIGHT_PRICES, config.n_flights)  # distinct, so the cheapest plan is unique
    if config.ordered_ids:
        prices.sort()
    flights = tuple(Flight(f"F{i + 1}", rng.randint(first, last), p) for i, p in enumerate(prices))
    nightly = rng.sample(HOTEL_NIGHT_PRICES, config.n_hotels)
    if config.ordered_ids:
        nightly.sort()
    hotels = tuple(Hotel(f"H{i + 1}", p) for i, p in enumerate(nightly))
    # One busy day where a trip from the window can hit it, so checking the calendar matters;
    # the rest anywhere.
    busy = {rng.randint(first, last + nights)}
    while len(busy) < config.n_busy:
        busy.add(rng.randint(1, config.max_day))
    return World(origin, destination, first, last, nights, flights, hotels, tuple(sorted(busy)),
                 budget=0, max_day=config.max_day)


def generate_world(rng: random.Random, config: TripWorldConfig = TripWorldConfig()) -> World:
    """A world with at least one valid plan and a unique cheapest one.

    With probability `trap_rate` the cheapest flight conflicts with the calendar (the agent
    must check before it books); otherwise it does not (the agent must not over-avoid).
    """
    want_trap = rng.random() < config.trap_rate
    for _ in range(10_000):  # rejection sampling: a valid world comes within a few draws
        world = _draw_world(rng, config)
        if all(world.conflicts(f) for f in world.flights):
            continue
        cheapest = min(world.flights, key=lambda f: f.price)
        if bool(world.conflicts(cheapest)) != want_trap:
            continue
        # The budget never decides the best plan (it admits the cheapest valid one by
        # construction); it bounds the demonstrator's pricier choices and the agent's mistakes.
        best = min(world.cost(f, h) for f in world.flights for h in world.hotels if not world.conflicts(f))
        world = replace(world, budget=int(math.ceil(best * (1 + rng.uniform(*config.budget_slack)) / 10) * 10))
        plans = valid_plans(world)
        if len(plans) == 1 or plans[0][2] < plans[1][2]:
            return world
    raise RuntimeError(f"trip_world: no valid world in 10000 draws for {config}")


def task_prompt(world: World) -> str:
    """The user turn, e.g. 'Trip LON>ROM, leave day 4-6, 3 nights, budget 900. Book the cheapest valid trip.'"""
    return (f"Trip {world.origin}>{world.destination}, leave day {world.first_day}-{world.last_day}, "
            f"{world.nights} nights, budget {world.budget}. Book the cheapest valid trip.")


def world_id(world: World) -> str:
    """A short stable id (for `Task.id`): route, window, nights and a digest of the rest."""
    digest = hashlib.sha1(to_json(world.to_dict()).encode()).hexdigest()[:8]
    return f"{world.origin}>{world.destination}:{world.first_day}-{world.last_day}:{world.nights}:{digest}"


# --- tools ---------------------------------------------------------------------------------------


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    """Count every call and every failed call, whatever the executor does with the exception."""

    @functools.wraps(method)
    def wrapper(self: TripTools, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(method.__name__)
        try:
            return method(self, *args, **kwargs)
        except Exception:
            self.errors += 1
            raise

    return wrapper


def _city(value: Any) -> str:
    return str(value).strip().upper()


def _day(value: Any, name: str, max_day: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole day number")
    if not 1 <= value <= max_day:
        raise ValueError(f"{name} must be 1-{max_day}")
    return value


class TripTools:
    """The simulated tools over one world, with the state `book` and `score_booking` need.

    Methods are the tools (typed, documented: `Tool.from_function(tools.book)` works).
    A failing call raises ValueError with a short message; the executor shows it as an error.
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.calls: list[str] = []  # tool names in call order, failed calls included
        self.errors = 0
        self.searched_flights = False
        self.searched_hotels = False
        self.checked_flights: set[str] = set()
        self.booking: tuple[str, str, int] | None = None  # (flight_id, hotel_id, cost)

    def functions(self) -> list[Callable[..., Any]]:
        """The tools as bound methods, in the order the model is shown them."""
        return [getattr(self, name) for name in TOOL_NAMES]

    @_counted
    def search_flights(self, origin: str, dest: str) -> list[dict[str, Any]]:
        """Search flights from one city to another, cheapest first.

        Args:
            origin: 3-letter code of the city to fly from, e.g. LON.
            dest: 3-letter code of the city to fly to, e.g. ROM.
        """
        w = self.world
        if (_city(origin), _city(dest)) != (w.origin, w.destination):
            raise ValueError(f"no flights {_city(origin)}>{_city(dest)}")
        self.searched_flights = True
        return [{"id": f.id, "day": f.day, "price": f.price} for f in w.by_price()]

    @_counted
    def search_hotels(self, city: str, nights: int) -> list[dict[str, Any]]:
        """Search hotels in a city, cheapest first; each price is the total for the given number of nights.

        Args:
            city: 3-letter code of the city, e.g. ROM.
            nights: How many nights to stay.
        """
        if _city(city) != self.world.destination:
            raise ValueError(f"no hotels in {_city(city)}")
        nights = _day(nights, "nights", self.world.max_day)
        self.searched_hotels = True
        return [{"id": h.id, "price": nights * h.night} for h in sorted(self.world.hotels, key=lambda h: h.night)]

    @_counted
    def check_calendar(self, flight: str) -> dict[str, list[int]]:
        """List the days the traveller is busy during the trip on a flight (its day through the day home).

        Args:
            flight: Id of a flight from the search, e.g. F2.
        """
        if not self.searched_flights:
            raise ValueError("search flights first")
        f = self._flight(str(flight).strip().upper())
        self.checked_flights.add(f.id)
        return {"busy": self.world.conflicts(f)}

    @_counted
    def book(self, flight: str, hotel: str) -> dict[str, Any]:
        """Book a round-trip flight and a hotel; the trip takes the day out through the day back.

        Args:
            flight: Id of the flight, e.g. F2.
            hotel: Id of the hotel, e.g. H1.
        """
        f, h = self._booking_options(str(flight).strip().upper(), str(hotel).strip().upper())
        w = self.world
        if f.id not in self.checked_flights:
            raise ValueError(f"check calendar for {f.id} first")
        if w.conflicts(f):
            raise ValueError(f"day {w.conflicts(f)[0]} busy")
        cost = w.cost(f, h)
        if cost > w.budget:
            raise ValueError(f"cost {cost} over budget {w.budget}")
        self.booking = (f.id, h.id, cost)
        return {"booked": f"{f.id},{h.id}", "cost": cost}

    def _booking_options(self, flight_id: str, hotel_id: str) -> tuple[Flight, Hotel]:
        """The searched flight and hotel these ids name, or the first reason they cannot be booked."""
        if self.booking is not None:
            raise ValueError("already booked")
        if not self.searched_flights:
            raise ValueError("search flights first")
        if not self.searched_hotels:
            raise ValueError("search hotels first")
        hotels = {h.id: h for h in self.world.hotels}
        flight = self._flight(flight_id)
        if hotel_id not in hotels:
            raise ValueError(f"unknown hotel {hotel_id}")
        return flight, hotels[hotel_id]

    def _flight(self, flight_id: str) -> Flight:
        for f in self.world.flights:
            if f.id == flight_id:
                return f
        raise ValueError(f"unknown flight {flight_id}")

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run tool `name` with keyword `arguments` (raises ValueError on an unknown name)."""
        if name not in TOOL_NAMES:
            self.calls.append(name)
            self.errors += 1  # counted like any failed call, though no method ran
            raise ValueError(f"unknown tool {name}")
        return getattr(self, name)(**arguments)


def replay(world: World, calls: list[tuple[str, dict[str, Any]]]) -> tuple[TripTools, list[str]]:
    """Run `calls` on a fresh `TripTools`; each observation is compact JSON or 'error: <message>'."""
    tools, observations = TripTools(world), []
    for name, arguments in calls:
        try:
            observations.append(to_json(tools.call(name, arguments)))
        except Exception as exc:  # the agent's mistakes are observations, not crashes
            observations.append(f"error: {exc}")
    return tools, observations


# --- the demonstrator and the score ---------------------------------------------------------------


def _calendar_calls(world: World, rng: random.Random, waste_rate: float,
                    check_all_rate: float = 0.0) -> list[tuple[str, dict]]:
    """Check the flights cheapest first until one is free; when wasteful, check every flight or one twice.

    With `check_all_rate` it checks every flight whatever it found (its habit, when that rate is
    above one half: the majority of its episodes, so a model trained on them does it every time).
    """
    ordered = [("check_calendar", {"flight": f.id}) for f in world.by_price()]
    if check_all_rate and rng.random() < check_all_rate:  # no draw at 0: other rates' streams unchanged
        return ordered
    calls = ordered[: world.first_free() + 1]
    if rng.random() >= waste_rate:
        return calls
    if len(calls) < len(ordered) and rng.random() < 0.5:
        return ordered  # over-careful: every flight, though one was free
    repeat = rng.randrange(len(calls))
    return calls[: repeat + 1] + calls[repeat:]


def demonstrator_calls(world: World, rng: random.Random, *, waste_rate: float = 0.5, pricier_rate: float = 0.3,
                       hasty_rate: float = 0.0, check_all_rate: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    """The scripted demonstrator's (tool, arguments) calls, ending with a `book` that always succeeds.

    Correct but wasteful, like a careful person: it checks the flights one by one, cheapest
    first, until one is free; with `waste_rate` it repeats a search or a check, or checks
    every flight; with `pricier_rate` it books a valid plan that is not the cheapest among
    those whose days it checked (a pricier hotel, or a pricier free flight). With
    `hasty_rate`, when the cheapest flight hits a busy day, it first tries to book that
    flight anyway, reads the "day N busy" error and then books a valid plan: a wasted call
    and an error, and an example of recovering from one. With `check_all_rate` it checks
    every flight before it books, though an earlier one was free (see `_calendar_calls`).
    """
    flights = ("search_flights", {"origin": world.origin, "dest": world.destination})
    hotels = ("search_hotels", {"city": world.destination, "nights": world.nights})
    calls = [flights] * (2 if rng.random() < waste_rate / 2 else 1)
    calls += [hotels] * (2 if rng.random() < waste_rate / 2 else 1)
    checks = _calendar_calls(world, rng, waste_rate, check_all_rate)
    calls += checks
    checked = {args["flight"] for _, args in checks}
    plans = [p for p in valid_plans(world) if p[0] in checked]
    flight_id, hotel_id, _ = rng.choice(plans[1:]) if len(plans) > 1 and rng.random() < pricier_rate else plans[0]
    cheapest_flight = world.by_price()[0]
    if world.conflicts(cheapest_flight) and rng.random() < hasty_rate:
        cheapest_hotel = min(world.hotels, key=lambda h: h.night)
        calls.append(("book", {"flight": cheapest_flight.id, "hotel": cheapest_hotel.id}))
    return calls + [("book", {"flight": flight_id, "hotel": hotel_id})]


def min_tool_calls(world: World) -> int:
    """The fewest calls that book the best plan knowing it is best: both searches, a check of
    every flight from the cheapest up to the first free one, and the booking."""
    return 2 + world.first_free() + 1 + 1


def score_booking(world: World, tools: TripTools) -> dict[str, Any]:
    """Outcome facts for rewards: did a valid booking happen, at what cost, with how many calls and errors.

    `cost` and `cost_ratio` are None without a booking; `optimal` is True when the booked
    plan is the cheapest valid one; `extra_calls` counts calls beyond `min_tool_calls(world)`.
    """
    optimal_cost = optimal_plan(world)[2]
    cost = tools.booking[2] if tools.booking else None
    booked = cost is not None  # `book` only records valid plans
    return {"success": booked, "cost": float(cost) if booked else None, "optimal_cost": float(optimal_cost),
            "cost_ratio": cost / optimal_cost if booked else None, "optimal": cost == optimal_cost,
            "tool_calls": len(tools.calls), "extra_calls": len(tools.calls) - min_tool_calls(world),
            "errors": tools.errors}


def split(config: TripWorldConfig = TripWorldConfig()) -> tuple[list[World], list[World]]:
    """Disjoint (train, held-out) worlds, deterministic for `config.seed`.

    World i is drawn from its own seeded RNG, so the held-out set (the first indices) never
    changes when `train_size` does; duplicates, within a split or across, are dropped.
    """
    worlds: list[World] = []
    seen: set[World] = set()
    index = 0
    while len(worlds) < config.heldout_size + config.train_size:
        world = generate_world(random.Random(f"trip:{config.seed}:{index}"), config)
        index += 1
        if world not in seen:
            seen.add(world)
            worlds.append(world)
    return worlds[config.heldout_size:], worlds[: config.heldout_size]
