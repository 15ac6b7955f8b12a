"""A two-host Ray cluster on one Linux machine (root only): network namespaces, veth pairs, a bridge, ``tc``.

Layout (``P`` is a prefix carrying the creating process id, so that concurrent runs never collide and a run
killed before its teardown is cleaned up by the next one)::

    netns Pbr   bridge br0, ports h0 and h1; no address, no route: nothing here reaches the machine's network
    netns Ph0   eth0 10.213.0.11/24 <-veth-> h0    Ray head (GCS 10.213.0.11:6379), drivers run here
    netns Ph1   eth0 10.213.0.12/24 <-veth-> h1    Ray worker node

Every Ray process and every driver runs on a host: in its network, mount and PID namespaces (``nsenter`` into the
host's first process, which ``ip netns exec ... unshare --mount --pid`` started; each host sees only its own
processes, as a pod does, so a driver attaches to its own host's raylet), with:

- ``GLOO_SOCKET_IFNAME=eth0`` (and ``NCCL_SOCKET_IFNAME``): without it gloo picks loopback and rendezvous fails;
  the Ray workers inherit it from their raylet;
- ``RAY_AUTH_MODE=token`` and a fresh ``RAY_AUTH_TOKEN``, so the cluster never depends on ``~/.ray/auth_token``;
- each host its own mount namespace (``unshare --mount --propagation private``) with a private tmpfs over
  ``/tmp``: Ray's session folder (``--temp-dir=/tmp/ray``), run folders and every other file a host writes there
  stay on that host, as on two real nodes. The built-in model cache is the one folder both hosts see (bound at
  the same path), as a model baked into the image would be. The test reads a host's files through
  :meth:`TwoHostCluster.host_path`.
- ``s3=True``: moto's S3 server listening on host 0's address (``S3_PORT``), with bucket :data:`BUCKET`; every
  process of the cluster gets ``AWS_ENDPOINT_URL`` and dummy credentials, so ``s3://`` storage is what both
  hosts share.

Each node offers 1 CPU by default, so Ray Train's PACK placement of 1-CPU workers must use both nodes.
``cap(host, "100mbit")`` puts a ``tbf`` qdisc on both ends of a host's veth (both directions of its link).
Teardown signals only the processes inside this cluster's namespaces (``ip netns pids``), never ``ray stop``,
which would kill every Ray process on the machine, then deletes the namespaces (their veths and the bridge go
with them). Example::

    with TwoHostCluster() as cluster:
        cluster.run(["raytrain-eks", "train", "--address", cluster.address, "--preset", "local-tiny"])
        cluster.host_path(0, "/tmp/work/runs")   # that host's run folders, as this process sees them
        with cluster.capped(1, "100mbit"):
            cluster.run(["raytrain-eks", "probe", "--address", cluster.address])
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import procs

SUBNET = "10.213.0"
HOST_IPS = (f"{SUBNET}.11", f"{SUBNET}.12")
IFNAME = "eth0"
GCS_PORT = 6379
S3_PORT = 9000
BUCKET = "twohost"
RAY_TEMP = "/tmp/ray"  # inside each host's private /tmp
WORKDIR = "/tmp/work"  # each host's private working folder: commands run there unless told otherwise
# Run as each host's first process, in a mount namespace of its own, which it then holds open: a private tmpfs
# over /tmp, keeping visible the folders given as arguments (the model cache both hosts share, and this project
# and its environment when they live under /tmp): each is bound aside under a scratch tmpfs on /mnt first, then
# moved back on top of the new /tmp.
_HOST_INIT = f"""set -e
mount -t tmpfs -o size=16m rtek-keep /mnt
i=0
for p in "$@"; do mkdir -p "/mnt/k$i"; mount --bind "$p" "/mnt/k$i"; i=$((i+1)); done
mount -t tmpfs -o size=4g,mode=1777 rtek-tmp /tmp
i=0
for p in "$@"; do mkdir -p "$p"; mount --move "/mnt/k$i" "$p"; i=$((i+1)); done
mkdir -p {WORKDIR}
echo ready
exec sleep infinity
"""
_PREFIX = "rtek"
_NAME = re.compile(rf"^{_PREFIX}(\d+)(br|h\d)$")


def requirement_missing() -> str | None:
    """Why the two-host cluster cannot be built here (a skip reason), or ``None`` when it can."""
    if os.geteuid() != 0:
        return "the two-host cluster needs root (ip netns, veth, tc); run the tests as root, as CI does"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the two-host cluster needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2"
    return None


def tool(name: str) -> str:
    """The path of a console script of this environment (``ray``, ``raytrain-eks``), else from ``PATH``."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} is not installed")
    return found


class ClusterError(RuntimeError):
    """A step of building or using the two-host cluster failed; the message names the command and its output."""


@dataclass(frozen=True)
class WorkerRecord:
    """One Ray Train worker as its host's own Ray logs show it."""

    host: int
    job_id: str
    worker_id: str
    node_id: str
    world_rank: int
    node_rank: int


class TwoHostCluster:
    """Two network namespaces joined by a bridge, each running a Ray node; a context manager that always cleans up.

    ``start_ray=False`` builds the network only. ``num_cpus`` is each node's Ray CPU count. ``logs_to``: on
    teardown, each host's Ray logs are copied there (``h0/``, ``h1/``) before its private ``/tmp`` goes.
    """

    def __init__(
        self,
        *,
        start_ray: bool = True,
        num_cpus: int = 1,
        object_store_mb: int = 512,
        logs_to: Path | None = None,
        s3: bool = False,
    ) -> None:
        self.prefix = f"{_PREFIX}{os.getpid()}"
        self.bridge_ns = f"{self.prefix}br"
        self.host_ns = [f"{self.prefix}h{i}" for i in range(len(HOST_IPS))]
        self.ips = list(HOST_IPS)
        self._made = len(HOST_IPS)  # hosts made so far: a replacement gets the next number and address
        self.address = f"{HOST_IPS[0]}:{GCS_PORT}"
        self._start_ray = start_ray
        self._num_cpus = num_cpus
        self._object_store_mb = object_store_mb
        self._logs_to = logs_to
        self._holders: list[subprocess.Popen[str]] = []
        self.env = _cluster_env()
        self.s3_url = f"http://{HOST_IPS[0]}:{S3_PORT}" if s3 else None
        if s3:
            self.env.update(
                AWS_ENDPOINT_URL=self.s3_url,
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                AWS_REGION="us-east-1",
                AWS_EC2_METADATA_DISABLED="true",
            )

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> TwoHostCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cleanup_stale()
        self._build_network()
        self._start_hosts()
        if self.s3_url:
            self._start_s3()
        if self._start_ray:
            self._start_nodes()

    def close(self) -> None:
        """Stop every process in the namespaces, delete them (veths, bridge and each host's
        private tmpfs go with them)."""
        if self._holders and self._logs_to is not None:  # read through the hosts, so before they stop
            for i in range(len(self._holders)):
                logs = self.session_logs(i)
                with contextlib.suppress(OSError, shutil.Error):
                    if logs.is_dir():
                        shutil.copytree(
                            logs, self._logs_to / f"h{i}", dirs_exist_ok=True, ignore_dangling_symlinks=True
                        )
        for ns in self.host_ns:
            _kill_namespace_processes(ns)
        for holder in self._holders:
            with contextlib.suppress(subprocess.TimeoutExpired):
                holder.wait(timeout=10)
            for pipe in (holder.stdout, holder.stderr):
                if pipe is not None:
                    pipe.close()
        for ns in (*self.host_ns, self.bridge_ns):
            _delete_namespace(ns)

    # -- hosts: a mount namespace each ---------------------------------------------------------------------------

    def _start_hosts(self) -> None:
        for ns in self.host_ns:
            self._holders.append(self._start_host(ns))

    def _start_host(self, ns: str) -> subprocess.Popen[str]:
        """The first process of a host: its mount namespace, with an empty private ``/tmp``."""
        cache = os.environ.get("RAYTRAIN_EKS_CACHE", "")
        keep = [cache] if cache else []
        # This project and its Python environment stay visible when a clone lives under /tmp.
        for path in (str(Path(__file__).resolve().parents[1]), sys.prefix):
            if Path(path).resolve().is_relative_to("/tmp") and not any(Path(path).is_relative_to(k) for k in keep):
                keep.append(str(Path(path).resolve()))
        # A PID namespace of its own too (with its own /proc): Ray finds "its" raylet by listing the processes it
        # can see, and a driver that saw both hosts' raylets would attach to the head's, not to its own host's.
        argv = ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private"]
        argv += ["--pid", "--fork", "--mount-proc", "sh", "-c", _HOST_INIT, "host-init", *keep]
        holder = subprocess.Popen(argv, cwd=cache or "/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            holder.kill()
            raise ClusterError(f"the mount namespace of {ns} did not start: {holder.stderr.read()[-2000:]}")
        return holder

    def replace_host(self, host: int) -> None:
        """Lose host ``host`` as a node is lost, and put a fresh one in its place.

        Every process of the host is killed at once (SIGKILL: its Ray node, its workers, its first process), so
        its private ``/tmp`` goes with its mount namespace; its network namespace is deleted. The new host gets
        the next name and address on the bridge, an empty ``/tmp``, and a Ray node that joins the head (as a node
        group's replacement instance would). ``host_path(host, ...)`` then means the new host.
        """
        old = self.host_ns[host]
        _kill_namespace_processes(old, grace=0.0)
        holder = self._holders[host]
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(timeout=10)
        for pipe in (holder.stdout, holder.stderr):
            if pipe is not None:
                pipe.close()
        _delete_namespace(old)
        number = self._made
        self._made += 1
        self.host_ns[host] = ns = f"{self.prefix}h{number}"
        self.ips[host] = f"{SUBNET}.{11 + number}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        self._link(host)
        self._holders[host] = self._start_host(ns)
        if self._start_ray:
            self._start_worker_node(host)

    def host_path(self, host: int, path: str | Path) -> Path:
        """Where this process sees ``path`` of host ``host`` (an absolute path inside that host)."""
        return Path(f"/proc/{self._init_pid(host)}/root") / str(path).lstrip("/")

    def _init_pid(self, host: int) -> int:
        """The pid (as this process sees it) of host ``host``'s first process, PID 1 of its PID namespace."""
        holder = self._holders[host].pid
        children = Path(f"/proc/{holder}/task/{holder}/children").read_text().split()
        if not children:
            raise ClusterError(f"host {host} has no first process (its namespace holder {holder} has no child)")
        return int(children[0])

    def _start_s3(self) -> None:
        server = [tool("moto_server"), "-H", self.ips[0], "-p", str(S3_PORT)]
        self.run(["sh", "-c", 'exec "$@" >/tmp/moto.log 2>&1 </dev/null &', "moto", *server], host=0, check=True)
        script = (
            "import time, boto3\n"
            "for _ in range(120):\n"
            "    try:\n"
            f"        boto3.client('s3').create_bucket(Bucket={BUCKET!r}); break\n"
            "    except Exception: time.sleep(0.5)\n"
            "else: raise SystemExit('moto did not answer')\n"
        )
        self.run([sys.executable, "-c", script], host=1, timeout=120, check=True)

    # -- network --------------------------------------------------------------------------------------------------

    def _build_network(self) -> None:
        for ns in (self.bridge_ns, *self.host_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i in range(len(self.host_ns)):
            self._link(i)

    def _link(self, host: int) -> None:
        """Join host ``host``'s network namespace to the bridge (port ``h<number in its name>``), with its address."""
        ns, ip = self.host_ns[host], self.ips[host]
        port = ns.removeprefix(self.prefix)
        # Both ends are created directly inside their namespaces: nothing appears in the machine's own.
        _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")

    def cap(self, host: int, rate: str) -> None:
        """Limit host ``host``'s link to ``rate`` (tc syntax: ``100mbit``, ``1gbit``) in both directions."""
        for ns, dev in ((self.host_ns[host], IFNAME), (self.bridge_ns, self.host_ns[host].removeprefix(self.prefix))):
            # burst: room for a 64 KiB GSO packet several times over; latency bounds the queue.
            qdisc = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc])

    def uncap(self, host: int) -> None:
        for ns, dev in ((self.host_ns[host], IFNAME), (self.bridge_ns, self.host_ns[host].removeprefix(self.prefix))):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    @contextlib.contextmanager
    def capped(self, host: int, rate: str) -> Iterator[None]:
        self.cap(host, rate)
        try:
            yield
        finally:
            self.uncap(host)

    # -- Ray ------------------------------------------------------------------------------------------------------

    def temp_dir(self, host: int) -> Path:
        """Host ``host``'s Ray temp folder, as this process sees it."""
        return self.host_path(host, RAY_TEMP)

    def session_logs(self, host: int) -> Path:
        """Host ``host``'s current Ray session logs, as this process sees them (``session_latest`` is a link to a
        path inside the host, so it is followed here, not by this process's own view of ``/tmp``)."""
        latest = self.temp_dir(host) / "session_latest"
        try:
            target = os.readlink(latest)
        except OSError:
            return latest / "logs"
        return (self.host_path(host, target) if target.startswith("/") else latest.parent / target) / "logs"

    def _start_nodes(self) -> None:
        ray = tool("ray")
        common = [f"--num-cpus={self._num_cpus}", f"--object-store-memory={self._object_store_mb * 2**20}"]
        common += ["--disable-usage-stats"]
        head = [ray, "start", "--head", f"--node-ip-address={self.ips[0]}", f"--port={GCS_PORT}"]
        head += ["--include-dashboard=false", f"--temp-dir={RAY_TEMP}", *common]
        head += [f"--system-config={json.dumps(procs.TEST_RAY_SYSTEM_CONFIG)}"]
        self.run(head, host=0, timeout=180, check=True)
        for i in range(1, len(self.host_ns)):
            self._start_worker_node(i)
        self.wait_for_nodes(len(self.host_ns))

    def _start_worker_node(self, host: int) -> None:
        worker = [tool("ray"), "start", f"--address={self.address}", f"--node-ip-address={self.ips[host]}"]
        worker += [f"--num-cpus={self._num_cpus}", f"--object-store-memory={self._object_store_mb * 2**20}"]
        worker += ["--disable-usage-stats", f"--temp-dir={RAY_TEMP}"]
        self.run(worker, host=host, timeout=180, check=True)

    def wait_for_nodes(self, count: int, timeout: float = 90) -> None:
        """Wait until ``count`` Ray nodes are alive, asked from a driver on the head host."""
        script = (
            f"import ray; ray.init(address={self.address!r}, log_to_driver=False, configure_logging=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        deadline = time.monotonic() + timeout
        while True:
            proc = self.run([sys.executable, "-c", script], host=0, timeout=120)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode == 0 and lines and lines[-1] == str(count):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{count} Ray nodes not alive after {timeout:.0f} s: {_tail(proc)}")
            time.sleep(1)

    def run(
        self,
        argv: Sequence[str],
        *,
        host: int = 0,
        timeout: float = 600,
        check: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | Path = WORKDIR,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``host`` (its network and mount namespaces), in ``cwd`` (a path inside that host),
        with the cluster's environment (plus ``env``)."""
        target = str(self._init_pid(host))
        cmd = ["nsenter", "--target", target, "--mount", "--net", "--pid", "--", "env", f"--chdir={cwd}", *argv]
        proc = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed on host {host} (exit {proc.returncode}): {_tail(proc)}")
        return proc

    def popen(
        self, argv: Sequence[str], *, host: int = 0, log: Path, cwd: str | Path = WORKDIR
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host`` as :meth:`run` does, without waiting; its output goes to ``log``."""
        target = str(self._init_pid(host))
        cmd = ["nsenter", "--target", target, "--mount", "--net", "--pid", "--", "env", f"--chdir={cwd}", *argv]
        with log.open("w") as out:
            return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def kill_train_workers(self, host: int, sig: signal.Signals = signal.SIGKILL) -> list[int]:
        """Send ``sig`` (SIGKILL; SIGSTOP for a hung rank) to every Ray Train worker process
        (``ray::RayTrainWorker``) running on host ``host``; their pids."""
        killed = []
        for pid in _namespace_pids(self.host_ns[host]):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::RayTrainWorker"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    killed.append(pid)
        return killed

    def train_workers(self) -> list[WorkerRecord]:
        """Every Ray Train worker each host's own Ray logs show (Ray Train's structured ``logs/train`` files)."""
        records: dict[tuple[int, str, str], WorkerRecord] = {}
        for host in range(len(self.host_ns)):
            folder = self.session_logs(host) / "train"
            for path in sorted(folder.glob("ray-train-*-worker-*.log")) if folder.is_dir() else []:
                for line in path.read_text(errors="replace").splitlines():
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(entry, dict) or entry.get("component") != "worker" or "world_rank" not in entry:
                        continue
                    key = (host, str(entry["job_id"]), str(entry["worker_id"]))
                    records[key] = WorkerRecord(
                        host=host,
                        job_id=key[1],
                        worker_id=key[2],
                        node_id=str(entry["node_id"]),
                        world_rank=int(entry["world_rank"]),
                        node_rank=int(entry["node_rank"]),
                    )
        return sorted(records.values(), key=lambda r: (r.job_id, r.world_rank))


def _cluster_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
    env.update(
        GLOO_SOCKET_IFNAME=IFNAME,
        NCCL_SOCKET_IFNAME=IFNAME,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


def cleanup_stale() -> None:
    """Remove the namespaces (and their processes) left by a two-host cluster whose creating process is gone."""
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_namespace_processes(ns)
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            _delete_namespace(ns)


def _namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    """SIGTERM every process in ``ns``, SIGKILL what is left after ``grace`` seconds (at once when it is 0), wait
    until none is left."""
    steps = ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)) if grace > 0 else ((signal.SIGKILL, 10.0),)
    for sig, wait in steps:
        pids = _namespace_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _namespace_pids(ns):
            time.sleep(0.2)


def _delete_namespace(ns: str) -> None:
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip()}")


def _tail(proc: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    return (proc.stdout[-chars:] + "\n" + proc.stderr[-chars:]).strip()
