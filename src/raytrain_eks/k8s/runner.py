"""The one seam for external programs (eksctl, helm, kubectl): argv lists, a timeout, captured output.

Nothing here builds a shell string: ``shell=True`` is never used, so no value from a configuration or a user can
become shell syntax. A failure raises :class:`CommandError`, which names the command, its exit status, the end of
what it printed on stderr and the next thing to do. A program that is not installed raises
:class:`MissingToolError` with how to install it; :func:`require_tools` checks every program a command needs before
it starts and names all the missing ones at once (:class:`MissingToolsError`). Example::

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from raytrain_eks.errors import UserError

STDERR_TAIL_LINES = 20
QUICK_TIMEOUT_S = 120  # a command that only reads (helm get, eksctl get): seconds before it is stopped
"""Lines of stderr kept in a :class:`CommandError` (the end is where programs say what went wrong)."""

DEFAULT_HINT = "Fix the problem above, then run the same raytrain-eks command again: it resumes where it stopped."

# How to install each program the deploy steps call, named in the error when it is missing.
INSTALL_HINTS: dict[str, str] = {
    "eksctl": "Install eksctl (https://eksctl.io/installation/), for example "
    "`curl -sL https://github.com/eksctl-io/eksctl/releases/latest/download/eksctl_Linux_amd64.tar.gz "
    "| tar xz -C /usr/local/bin` on Linux or `brew install eksctl` on macOS.",
    "helm": "Install Helm 3.13 or later, or Helm 4 (https://helm.sh/docs/intro/install/), for example "
    "`curl -fsSL https://raw.githubusercontent.com/helm/helm/main/scripts/get-helm-3 | bash` or "
    "`brew install helm`.",
    "kubectl": "Install kubectl (https://kubernetes.io/docs/tasks/tools/), for example `brew install kubectl`, "
    "or the binary from https://dl.k8s.io/release/stable.txt.",
    "aws": "Install the AWS CLI v2 (https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html), "
    "for example `curl -sSLo awscliv2.zip https://awscli.amazonaws.com/awscli-exe-linux-x86_64.zip && unzip -q "
    "awscliv2.zip && sudo ./aws/install` on Linux or `brew install awscli` on macOS; or `pip install awscli`.",
    "aws-iam-authenticator": "Install aws-iam-authenticator "
    "(https://github.com/kubernetes-sigs/aws-iam-authenticator/releases), for example `brew install "
    "aws-iam-authenticator`; or, with the AWS CLI installed instead, run `raytrain-eks up` again: it writes the "
    "kubeconfig anew, and eksctl then names `aws eks get-token` in it.",
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


class MissingToolsError(MissingToolError):
    """Programs a command needs are not installed: every one named in one message, each with what it is needed for
    and how to install it. ``tools``: their names, in the order given; ``tool``: the first."""

    exit_code = 2

    def __init__(self, missing: Mapping[str, str]) -> None:
        self.tools = list(missing)
        self.tool = self.tools[0]
        names = ", ".join(f"`{name}`" for name in self.tools)
        if len(self.tools) == 1:
            head = f"{names} is not installed (not found on PATH), and this command needs it:"
        else:
            head = f"{len(self.tools)} programs this command needs are not installed (not found on PATH): {names}"
        lines = [head, *(f"  - {name}: {why}" for name, why in missing.items())]
        hints = [f"{name}: {_install_hint(name)}" for name in missing]
        UserError.__init__(
            self,
            "\n".join(lines),
            hint="\n".join([*hints, "Then run the same raytrain-eks command again: nothing was created or changed."]),
        )


def _install_hint(name: str) -> str:
    """How to install ``name`` (a kubeconfig may name a program by its full path)."""
    return INSTALL_HINTS.get(os.path.basename(name), f"Install {name} and make sure it is on PATH.")


def require_tools(needs: Sequence[tuple[Sequence[str], str]], require: Callable[[str], object] | None = None) -> None:
    """Check every program of ``needs`` before anything runs; raise one :class:`MissingToolsError` naming all the
    missing ones. Each need is ``(names, why)``: any one of ``names`` will do (the first is the one named when none
    is installed), ``why`` says what it is needed for. ``require`` checks one name (default :func:`require_tool`).

    Example: ``require_tools([(["eksctl"], "the cluster"), (["aws", "aws-iam-authenticator"], "credentials")])``.
    """
    check = require or require_tool
    missing: dict[str, str] = {}
    for names, why in needs:
        if not names or names[0] in missing:
            continue
        for name in names:
            try:
                check(name)
                break
            except MissingToolError:
                continue
        else:
            others = [f"`{n}`" for n in names[1:]]
            missing[names[0]] = why + (f" (or {' or '.join(others)} instead)" if others else "")
    if missing:
        raise MissingToolsError(missing)


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
