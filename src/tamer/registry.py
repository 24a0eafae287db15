"""A tiny name -> object registry, shared by every pluggable family in tamer.

Advantage estimators, policy losses, reward functions, tasks and environments each
keep one `Registry`; configs and the CLI refer to entries by name, and an unknown name
fails with a message that lists the valid ones.

    ADVANTAGES = Registry("advantage estimator")

    @ADVANTAGES.register("grpo")
    def grpo(rewards, group_ids): ...

    fn = ADVANTAGES.get("grpo")

An entry whose module is costly to import (the code task pulls in the sandbox) is registered
lazily by "module:attribute" and imported on first `get`; its name is valid right away.

    REWARDS.register_lazy("unit_tests", "tamer.tasks.code_check:unit_tests")
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (functions or classes) of one family."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}  # name -> "module:attribute", imported on first get

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def register_lazy(self, name: str, target: str) -> None:
        """Register `name` as "module:attribute"; the module is imported on the first `get(name)`."""
        self._lazy[name] = target

    def get(self, name: str) -> T:
        if name not in self._entries and name in self._lazy:
            module, _, attribute = self._lazy[name].partition(":")
            obj = getattr(importlib.import_module(module), attribute)
            self._entries.setdefault(name, obj)  # importing the module may have registered it already
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(self.names()) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._lazy))

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def bind(fn: Callable, source: Any) -> Callable:
    """`fn` with its keyword-only parameters fixed from the same-named attributes of `source`.

    Parameters `source` does not have keep their defaults. A trainer binds a registered
    function's hyperparameters once, from its config, instead of passing every one to all:

        loss_fn = bind(POLICY_LOSSES.get("gspo"), algorithm_config)   # gspo_eps_low, gspo_eps_high
    """
    params = inspect.signature(fn).parameters.values()
    kwargs = {p.name: getattr(source, p.name) for p in params
              if p.kind is inspect.Parameter.KEYWORD_ONLY and hasattr(source, p.name)}
    return functools.partial(fn, **kwargs)
