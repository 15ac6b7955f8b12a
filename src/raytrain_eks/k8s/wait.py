"""One way to wait for the cluster: poll with a deadline, say what is awaited as it changes, fail with one message.

Example::

    pods = poll(
        lambda: (ready_pods() or None, f"{len(ready_pods())}/{want} pods running"),
        what="Ray pods",
        timeout=600,
        clock=time.monotonic,
        sleep=time.sleep,
        say=print,
        on_timeout=lambda last, waited: UserError(f"Ray pods not running after {waited:.0f} s ({last})"),
    )
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from raytrain_eks.errors import UserError

T = TypeVar("T")

POLL_S = 10.0


def poll(
    probe: Callable[[], tuple[T | None, str]],
    *,
    what: str,
    timeout: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    say: Callable[[str], None],
    interval: float = POLL_S,
    on_timeout: Callable[[str, float], Exception] | None = None,
) -> T:
    """Call ``probe`` until it returns a value that is not None, and return that value.

    ``probe`` returns ``(value, progress)``: ``value`` is None while waiting, and ``progress`` says in a few words
    where things stand. Each time the progress changes, one line says what is awaited, the progress, the time
    waited and the deadline. When ``timeout`` seconds pass, the error ``on_timeout(progress, waited_s)`` is raised
    (by default a :class:`UserError` naming what was awaited and its last state).
    """
    start = clock()
    last = None
    while True:
        value, progress = probe()
        if value is not None:
            return value
        waited = clock() - start
        if waited >= timeout:
            if on_timeout is not None:
                raise on_timeout(progress, waited)
            raise UserError(
                f"{what}: still {progress} after {waited:.0f} s (deadline {timeout:.0f} s)",
                hint="Run the same raytrain-eks command again to keep waiting; `raytrain-eks status` shows the state.",
            )
        if progress != last:
            say(f"Waiting for {what}: {progress} ({waited:.0f} s of {timeout:.0f} s)")
            last = progress
        sleep(min(interval, timeout - waited))
