"""Errors a user can act on: each names the file, the row where there is one, and the reason."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class; the CLI prints these without a traceback."""


class InputError(TokenmillError):
    """The input cannot be read as a corpus at all (a structural error). Fails the job."""

    def __init__(self, uri: str, reason: str, *, row: int | None = None, column: str | None = None):
        self.uri, self.reason, self.row, self.column = uri, reason, row, column
        where = uri
        if row is not None:
            where += f", row {row}"
        if column is not None:
            where += f", column '{column}'"
        super().__init__(f"{where}: {reason}")


class ConfigError(TokenmillError):
    """The job spec asks for something that cannot work."""
