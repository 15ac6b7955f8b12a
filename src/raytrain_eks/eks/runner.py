"""The one seam for external programs (eksctl, helm, kubectl): argv lists, a timeout, captured output.

Nothing here builds a shell string: ``shell=True`` is never used, so no value from a configuration or a user can
become shell syntax. A failure raises :class:`CommandError`, which names the command, its exit status, the end of
what it printed on stderr and the next thing to do. A program that is not installed raises
:class:`MissingToolError` with how to install it. Example::

    done = run(["helm", "version", "--short"], timeout=30)
    done.stdout  # "v3.19.0+g..."

    run(["eksctl", "get", "cluster", "--name", "x"], timeout=60, check=False).returncode

Deploy steps take any :class:`Runner` (this module's :func:`run`, or a recording fake in the tests).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from raytrain_eks.errors import UserError

STDERR_TAIL_LINES = 20
"""Lines of stderr kept in a :class:`CommandError` (the end is where programs say what went wrong)."""

DEFAULT_HINT = "Fix the problem above, then run the same raytrain-eks command again: it resumes where it stopped."

# How to install each program the deploy steps call, named in the error when it is missing.
INSTALL_HINTS: dict[str, str] = {
    "eksctl": "Install eksctl (https://eksctl.io/installation/), for example "
    "`curl -sL https://github.com/eksctl-io/eksctl/releases/latest/download/eksctl_Linux_amd64.tar.gz "
    "| tar xz -C /usr/local/bin` on Linux or `brew install eksctl` on macOS.",
    "helm": "Install Helm 3 (https://helm.sh/docs/intro/install/), for example "
    "`curl -fsSL https://raw.githubusercontent.com/helm/helm/main/scripts/get-helm-3 | bash` or "
    "`brew install helm`.",
    "kubectl": "Install kubectl (https://kubernetes.io/docs/tasks/tools/), for example `brew install kubectl`, "
    "or the binary from https://dl.k8s.io/release/stable.txt.",
}


@dataclass(frozen=True)
class Completed:
    """A finished command: its argv, exit status and captured output (text)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandError(UserError):
    """An external command failed or timed out.

    ``argv``: the command; ``returncode``: its exit status (``None`` when it was stopped at its timeout);
    ``stderr_tail``: the last lines it wrote to stderr; ``hint``: the next thing the user should do.
    """

    exit_code = 1

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int | None,
        stderr: str,
        *,
        hint: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stderr_tail = tail(stderr)
        self.timed_out = returncode is None
        status = f"timed out after {timeout:.0f} s" if returncode is None else f"failed with exit status {returncode}"
        message = f"`{shlex.join(self.argv)}` {status}"
        if self.stderr_tail:
            message += ":\n" + "\n".join(f"  {line}" for line in self.stderr_tail.splitlines())
        super().__init__(message, hint=hint or DEFAULT_HINT)


class Interrupted(UserError):
    """The user stopped raytrain-eks (Ctrl-C, or SIGTERM) while a command ran; the command and every process it
    started were stopped before this was raised. ``argv``: the command; ``signal_name``: ``Ctrl-C`` or ``SIGTERM``.

    The deploy steps add what their state file records (:meth:`with_state`); the hint says that running the same
    raytrain-eks command again resumes.
    """

    exit_code = 130

    def __init__(self, argv: Sequence[str], signal_name: str, *, state: str | None = None) -> None:
        self.argv = tuple(argv)
        self.signal_name = signal_name
        self.state = state
        message = (
            f"stopped by {signal_name} while `{shlex.join(self.argv)}` ran; it and every process it started were "
            "stopped too. What it had already created stays as it was (a CloudFormation stack, for example, may be "
            "half made)."
        )
        if state:
            message += "\n" + state
        super().__init__(
            message,
            hint="Run the same raytrain-eks command again: it looks at what exists and resumes where it stopped "
            "(`raytrain-eks status` shows it; `raytrain-eks down` deletes what this folder created).",
        )

    def with_state(self, state: str) -> Interrupted:
        """The same interruption, its message extended with ``state`` (what the state file records)."""
        return Interrupted(self.argv, self.signal_name, state=state)


class _Terminated(BaseException):
    """SIGTERM arrived while a command ran (raised by the handler :func:`_sigterm_raises` installs)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`_Terminated` (as SIGINT raises KeyboardInterrupt) instead of
    ending this process at once and leaving the command's own process group running. Signal handlers can only be
    set in the main thread; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class MissingToolError(UserError):
    """A program the step needs is not installed (not on ``PATH``)."""

    exit_code = 2

    def __init__(self, name: str) -> None:
        self.tool = name
        super().__init__(
            f"`{name}` is not installed (not found on PATH)",
            hint=INSTALL_HINTS.get(name, f"Install {name} and make sure it is on PATH."),
        )


class Runner(Protocol):
    """What deploy steps call to run a program; :func:`run` is the real one."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        input: str | None = None,
        check: bool = True,
        hint: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> Completed: ...


def tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of ``text``."""
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def require_tool(name: str) -> str:
    """The full path of ``name``, or :class:`MissingToolError` saying how to install it.

    Example: ``require_tool("eksctl")`` before a step that would otherwise fail half-way.
    """
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(name)
    return path


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: str | None = None,
    check: bool = True,
    hint: str | None = None,
    on_output: Callable[[str], None] | None = None,
) -> Completed:
    """Run ``argv`` (a list, never a shell string) and wait at most ``timeout`` seconds.

    ``input`` is written to its stdin. ``on_output`` receives each line of stdout and stderr as it arrives (long
    commands such as ``eksctl create cluster`` show progress that way). With ``check`` a non-zero exit raises
    :class:`CommandError` carrying ``hint``; without it the :class:`Completed` is returned either way. A timeout
    always raises, after the command and everything it started have been stopped.
    """
    if isinstance(argv, str):
        raise TypeError("run() takes an argv list, not a string")
    args = [str(a) for a in argv]
    if not args:
        raise ValueError("run() needs a program to run")
    exe = require_tool(args[0])
    with _sigterm_raises():
        try:
            returncode, out, err = _run_child(exe, args, timeout=timeout, input=input, hint=hint, on_output=on_output)
        except KeyboardInterrupt:
            raise Interrupted(args, "Ctrl-C") from None
        except _Terminated:
            raise Interrupted(args, "SIGTERM") from None
    done = Completed(tuple(args), returncode, out, err)
    if check and returncode != 0:
        raise CommandError(args, returncode, done.stderr or done.stdout, hint=hint)
    return done


def _run_child(
    exe: str,
    args: list[str],
    *,
    timeout: float,
    input: str | None,
    hint: str | None,
    on_output: Callable[[str], None] | None,
) -> tuple[int, str, str]:
    """Start the command in its own process group and wait for it; whatever ends the wait early (the timeout,
    Ctrl-C, SIGTERM) stops the whole group before it propagates."""
    try:
        proc = subprocess.Popen(
            [exe, *args[1:]],
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            # Its own process group, so that stopping it stops the children it started too. It also means a Ctrl-C
            # in the terminal never reaches it: this process stops the group itself.
            start_new_session=True,
        )
    except FileNotFoundError:
        raise MissingToolError(args[0]) from None
    out: list[str] = []
    err: deque[str] = deque(maxlen=2000)
    readers = [
        threading.Thread(target=_pump, args=(proc.stdout, out.append, on_output), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, err.append, on_output), daemon=True),
    ]
    try:
        for t in readers:
            t.start()
        if input is not None and proc.stdin is not None:
            try:
                proc.stdin.write(input)
                proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            for t in readers:
                t.join(timeout=5)
            raise CommandError(args, None, "".join(err), hint=hint, timeout=timeout) from None
    except BaseException:  # Ctrl-C, SIGTERM, or anything else: never leave the group running
        _stop(proc)
        for t in readers:
            t.join(timeout=5)
        raise
    for t in readers:
        t.join()
    return returncode, "".join(out), "".join(err)


def _pump(stream: IO[str] | None, keep: Callable[[str], None], on_output: Callable[[str], None] | None) -> None:
    if stream is None:
        return
    for line in stream:
        keep(line)
        if on_output is not None:
            on_output(line.rstrip("\n"))
    stream.close()


STOP_GRACE_S = 10.0
"""Seconds a stopped command's process group gets to exit after SIGTERM before it is killed."""


def _stop(proc: subprocess.Popen[str], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the command's whole process group, then SIGKILL to whatever of it is left after ``grace``
    seconds (a grandchild that outlives its parent too). Safe to call twice."""
    group = proc.pid  # start_new_session: the group id is the child's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(group):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    proc.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True
