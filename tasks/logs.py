"""Route the core's log records (retries, engine restarts) into the Prefect run's log."""

from __future__ import annotations

import functools
import logging
from typing import Callable, TypeVar

from prefect import get_run_logger

F = TypeVar("F", bound=Callable)


class _ToRunLogger(logging.Handler):
    def __init__(self, run_logger: logging.LoggerAdapter):
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, "%s", record.getMessage())


def with_core_logs(function: F) -> F:
    """The task's body logs what `tokenmill` logs (INFO and up) to the task run's log."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        core = logging.getLogger("tokenmill")
        handler = _ToRunLogger(get_run_logger())
        previous_level = core.level
        core.addHandler(handler)
        if core.getEffectiveLevel() > logging.INFO:
            core.setLevel(logging.INFO)
        try:
            return function(*args, **kwargs)
        finally:
            core.removeHandler(handler)
            core.setLevel(previous_level)

    return wrapper  # type: ignore[return-value]
