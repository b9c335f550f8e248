"""The errors silodp raises on purpose, under one base class.

Every error a user can cause (a bad value, a malformed config, an unreachable privacy target,
results already on disk) is a :class:`SilodpError` whose message names the value and what was
expected; the command line prints that message and exits with code 2. The subclasses keep the
built-in exception they refine (``ValueError``, ``FileExistsError``) as a second base, so code
written against those keeps working.
"""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "ConfigError",
    "InvalidValueError",
    "OutputExistsError",
    "SilodpError",
]


class SilodpError(Exception):
    """Base of every error silodp raises for bad input or an impossible request."""


class InvalidValueError(SilodpError, ValueError):
    """A value is out of range or of the wrong kind (the message names it)."""


class ConfigError(InvalidValueError):
    """A config file is malformed: unknown key, wrong type or value out of range."""


class CalibrationError(InvalidValueError):
    """The target ε cannot be met by any noise multiplier silodp will consider."""


class OutputExistsError(SilodpError, FileExistsError):
    """The output directory already holds results of a run."""
