"""A tiny name -> object registry, shared by every pluggable family in tamer.

Advantage estimators, policy losses, reward functions, tasks and environments each
keep one `Registry`; configs and the CLI refer to entries by name, and an unknown name
fails with a message that lists the valid ones.

    ADVANTAGES = Registry("advantage estimator")

    @ADVANTAGES.register("grpo")
    def grpo(rewards, group_ids): ...

    fn = ADVANTAGES.get("grpo")
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (functions or classes) of one family."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries)) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
