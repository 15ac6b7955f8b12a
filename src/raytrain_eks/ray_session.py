"""Ray for the tool's own jobs (training and the bandwidth probe): start or join it, size the workers, fit.

Example::

    init_ray(address=None, num_workers=2, verbose=False)      # a new local Ray of our own
    workers, use_gpu = resolve_num_workers(0, int(ray.cluster_resources().get("GPU", 0)))
    result = fit_keeping_sigint(trainer)                      # Ctrl-C still stops this process afterwards
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from raytrain_eks.errors import UserError

if TYPE_CHECKING:
    from ray.train import Result
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

LOCAL_CPU_WORKERS = 2


def resolve_num_workers(requested: int, cluster_gpus: int) -> tuple[int, bool]:
    """(workers, use_gpu): ``requested`` when set, else one per GPU in the Ray cluster, else 2 CPU workers."""
    use_gpu = cluster_gpus > 0
    if requested:
        return requested, use_gpu
    return (cluster_gpus, True) if use_gpu else (LOCAL_CPU_WORKERS, False)


def fit_keeping_sigint(trainer: DataParallelTrainer) -> Result:
    """``trainer.fit()``, then the process's Ctrl-C handler as it was before.

    Ray Train's ``fit`` (run on the main thread) installs a SIGINT handler that aborts its controller and never
    removes it: a later Ctrl-C would call a controller that is gone instead of stopping this process.
    """
    if threading.current_thread() is not threading.main_thread():
        return trainer.fit()
    before = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    finally:
        signal.signal(signal.SIGINT, before)


def init_ray(address: str | None, num_workers: int, verbose: bool) -> None:
    """Join the Ray cluster at ``address``, or start a Ray of our own on this machine (sized for ``num_workers``).

    Does nothing more when Ray is already initialised in this process, so calling it twice is harmless. Unless
    ``verbose``, Ray's logs and Ray Data's progress bars are quieted. A cluster that cannot be reached is a
    :class:`UserError`.
    """
    import ray

    if not verbose:  # Ray Data logs every operator's progress; the driver shows its own one-line summary
        for name in ("ray", "ray.data", "ray.train"):
            logging.getLogger(name).setLevel(logging.ERROR)
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False  # and its bars: the driver shows one display
    if ray.is_initialized():
        return
    kwargs: dict[str, object] = {"log_to_driver": verbose, "configure_logging": verbose}
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(
                f"cannot connect to the Ray cluster at {address}: {str(exc).strip().splitlines()[0]}",
                hint="Is the cluster up? Check with `ray status`, or leave --address out to train on this machine.",
            ) from None
    else:
        # Logical CPUs: one per training worker plus room for Ray Data's tasks, even on a 2-core machine.
        cpus = max(os.cpu_count() or 1, num_workers + 2)
        # The modules a run needs next are imported while Ray's own processes start (most of ray.init is waiting).
        warm = threading.Thread(target=_import_train_modules, name="import-ray-train", daemon=True)
        warm.start()
        # address="local": always a new Ray of our own, never one some other program started on this machine.
        with local_ray_environment():
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, **kwargs)
        _start_resource_coordinator()
        warm.join()


class LocalRayStart:
    """A Ray of our own (:func:`init_ray` without an address) started on a thread while the caller goes on.

    A run starts it as soon as its quick checks pass, so Ray's processes come up on one core while the other loads
    torch and transformers for the model check (both take seconds on a small machine). :meth:`wait` returns once Ray
    is up (or raises what stopped it). Ray asks Linux to end its processes with the thread that started them, so the
    thread stays until :meth:`stop`, which shuts Ray down.
    """

    def __init__(self, num_workers: int, verbose: bool) -> None:
        self._up = threading.Event()
        self._stopped = threading.Event()
        self._stopping = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(num_workers, verbose), name="start-local-ray", daemon=True
        )
        self._thread.start()

    def _run(self, num_workers: int, verbose: bool) -> None:
        try:
            init_ray(None, num_workers, verbose)
        except BaseException as exc:  # handed to whoever waits
            self._error = exc
        finally:
            self._up.set()
        self._stopped.wait()

    def wait(self) -> None:
        self._up.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Shut the Ray it started down (after it is up) and let its thread end; waits for a shutdown begun by
        :meth:`stop_soon`. Calling it again does nothing more."""
        import ray

        self._up.wait()
        with self._stopping:
            try:
                if not self._stopped.is_set() and ray.is_initialized():
                    ray.shutdown()
            finally:
                self._stopped.set()
        self._thread.join(timeout=30)

    def stop_soon(self) -> None:
        """Begin :meth:`stop` on another thread: for when nothing needs Ray any more but the caller has other work
        (the export and report of a finished run), so Ray's processes end meanwhile."""
        threading.Thread(target=self.stop, name="stop-local-ray", daemon=True).start()


# The environment of a Ray this tool starts on one machine. Ray Train's preemption watcher (one more actor process,
# started before the workers: 4-5 s of the start-up on 2 cores) follows node drains of a cluster; one machine has none.
# Its controller looks at the workers every 2 s by default, so a finished run waited up to 2 s to be noticed.
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


@contextlib.contextmanager
def local_ray_environment() -> Iterator[None]:
    """``os.environ`` with :data:`LOCAL_RAY_ENV` set while inside (values the user set stay as they are): wrap the
    start of a Ray on one machine in it, since Ray's processes keep the environment they start with."""
    added = {k: v for k, v in LOCAL_RAY_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _start_resource_coordinator() -> None:
    """Start the resource coordinator actor that Ray Train's controller asks for its workers' resources.

    The controller creates it on first use and waits for its answer (up to 5 s) before it starts any worker; its
    process (which imports Ray Data) then comes up on a machine busy starting the others. Started here, right after
    a local Ray, it is ready by the time a trainer asks, and the controller finds it by name. Only an optimisation:
    if this Ray has no such actor, the controller creates its own as before.
    """
    with contextlib.suppress(Exception):
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()


def _import_train_modules() -> None:
    with contextlib.suppress(Exception):  # whoever imports it for real reports the problem
        import ray.train.torch  # noqa: F401  (Ray Train and Ray Data: about 2 s of imports on a small machine)


def address_from_environment(address: str | None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The Ray cluster a run joins, and where that came from: ``--address``, else ``RAY_ADDRESS`` as ``ray.init()``
    reads it (set inside a Ray cluster's pods, so a run there joins that cluster rather than starting a second Ray
    beside it), else ``None``: a Ray of the run's own. Example: ``(None, "")`` with neither."""
    if address:
        return address, "--address"
    found = (os.environ if environ is None else environ).get("RAY_ADDRESS", "").strip()
    return (found, "RAY_ADDRESS") if found else (None, "")


def joined_address(address: str | None, say: Callable[[str], None]) -> str | None:
    """:func:`address_from_environment`'s address, saying so when it comes from ``RAY_ADDRESS`` (a run that joins a
    cluster the user did not name on its command line says which, and how not to)."""
    found, origin = address_from_environment(address)
    if origin == "RAY_ADDRESS":
        say(f"ray: joining the cluster RAY_ADDRESS names ({found}); unset it to run on a Ray of this command's own")
    return found


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody listens on (ray.init would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise UserError(
            f"cannot connect to the Ray cluster at {address}: {exc.strerror or exc}",
            hint="Is the cluster up? Check with `ray status`, or leave --address out to train on this machine.",
        ) from None


def worker_error(exc: BaseException) -> str:
    """One line for a failed Ray Train run: the first failed rank and the last line of its error.

    A :class:`UserError` raised in a worker keeps its message, its first line (the last one is its hint).
    """
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, err = sorted(failures.items())[0]
        cause: BaseException = err
        while (inner := getattr(cause, "cause", None)) is not None:
            cause = inner
        if isinstance(cause, UserError) and str(cause).strip():
            return f"rank {rank}: {str(cause).strip().splitlines()[0]}"
        lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
        return f"rank {rank}: {lines[-1] if lines else type(cause).__name__}"
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def worker_host_addresses() -> list[str]:
    """The addresses of the nodes :func:`worker_hosts` counts, sorted: where a run on the connected cluster can place
    its workers (its segments record them)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    key = "GPU" if any(n.get("Resources", {}).get("GPU", 0) > 0 for n in alive) else "CPU"
    return sorted(str(n.get("NodeManagerAddress")) for n in alive if n.get("Resources", {}).get(key, 0) >= 1)


def worker_hosts() -> int:
    """Alive nodes of the connected Ray cluster that can host a training worker: with GPUs when the cluster has
    any (workers then take one GPU each), else with CPUs. A head started with ``num-cpus 0`` and no GPU counts not.
    """
    import ray

    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    key = "GPU" if any(r.get("GPU", 0) > 0 for r in alive) else "CPU"
    return sum(1 for r in alive if r.get(key, 0) >= 1)
