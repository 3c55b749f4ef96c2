"""In-process progress events, so a CLI or UI can follow a run without the core knowing it."""

from __future__ import annotations

from typing import Any, Callable

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> Callable[[], None]:
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def emit(event: str, **data: Any) -> None:
    for listener in list(_listeners):
        listener(event, data)
