"""Errors that reach the user as one clear message instead of a traceback.

Every error the CLI catches is a :class:`UserError`: it carries the message to print and the exit code.
Example::

    raise ConfigError(["training.steps = -1 (from STEPS): must be at least 1"])
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; ``str(err)`` is the whole message, ``exit_code`` the process status."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n{hint}")

    def extend(self, text: str) -> None:
        """Add ``text`` to the end of the message, for example where the full traceback was written."""
        self.message = f"{self.message} {text}"
        self.args = (self.message if self.hint is None else f"{self.message}\n{self.hint}",)


class ConfigError(UserError):
    """The configuration is invalid. Holds every problem found, so they can be fixed in one go."""

    exit_code = 2

    def __init__(self, problems: list[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        noun = "problem" if len(problems) == 1 else "problems"
        lines = [f"Invalid configuration{where}: {len(problems)} {noun}"]
        lines += [f"  - {p}" for p in problems]
        super().__init__(
            "\n".join(lines),
            hint="Fix the values above (YAML file, environment variable or flag) and run the command again.",
        )


class DataError(UserError):
    """The training data cannot be used (missing, unreadable, or without a single usable row)."""

    exit_code = 2


class TrainingError(UserError):
    """Training started but failed; the message names the failing worker's error.

    ``details``: the failed workers' full tracebacks, when they sent them (for the run's error.log).
    """

    exit_code = 1
    details: str | None = None


class RunFolderError(UserError):
    """A folder given as a run folder is not one, or holds nothing to report yet."""

    exit_code = 2
