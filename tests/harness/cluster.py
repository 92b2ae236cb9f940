"""An isolated multi-node Ray cluster on one machine, grown and shrunk by Ray's own autoscaler.

Ray's fake multi-node provider (``provider.type: fake_multinode``, enabled by ``RAY_FAKE_CLUSTER=1``)
runs the real cluster autoscaler (``monitor.py``) against "nodes" that are extra raylets on this
machine: a pending actor that fits no node makes the autoscaler add one of the node type that fits it,
and a node idle for ``idle_timeout_minutes`` is removed. Each node declares its type's resources, so
placement by custom resource (``cpu_tier`` / ``engine_node``, as in ``configs/gpu-layout.yaml`` and
the KubeRay manifest) is exercised exactly as on a real cluster.

:class:`LocalAutoscalingCluster` starts one such cluster with nothing shared with any other Ray on the
machine: its own temp dir (``/tmp/sa_ray_XXXXXXXX``, short: Ray's socket paths live under it), its own
GCS, client-server, agent and worker ports, ``ray start --head --block`` in a new session
(``start_new_session=True``). Teardown (:func:`teardown_cluster`, also usable from another process
given only the temp dir) ends exactly what belongs to that cluster and verifies that nothing is left:

* every process in the ``ray start`` session (the head's processes, the autoscaler, the fake worker
  nodes it launches and their workers: none of them leaves the session; Ray only changes process
  groups), every process whose command line names the temp dir, and every descendant of those;
* first the autoscaler (so it launches nothing more), then ``ray start`` (which stops the head's
  processes), then SIGTERM to the rest, then SIGKILL, scanning again until a scan finds nothing;
* the temp dir (logs, sockets, and ``TMPDIR`` of every cluster process, so vLLM's IPC files too).

Never ``ray stop``: it ends every Ray process on the machine, other people's clusters included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.net import free_port

__all__ = [
    "FAKE_HEAD_NODE_ID",
    "HEAD_TYPE",
    "LocalAutoscalingCluster",
    "NodeType",
    "TeardownReport",
    "cluster_processes",
    "node_type_of",
    "teardown_cluster",
]

HEAD_TYPE = "ray.head.default"
FAKE_HEAD_NODE_ID = "f" * 51 + "00000"  # ray start --head under RAY_FAKE_CLUSTER=1 takes this node id
STATE_FILE = "serve_app_cluster.json"  # in the temp dir: what teardown from another process needs
_STANDARD_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


@dataclass(frozen=True)
class NodeType:
    """One worker node type of the autoscaling config: what each node declares, how many may exist."""

    resources: dict[str, float]
    min_workers: int = 0
    max_workers: int = 1


@dataclass
class TeardownReport:
    """What teardown found and ended; ``left`` must be empty."""

    found: int = 0
    terminated: int = 0
    killed: int = 0
    zombies: int = 0
    left: list[str] = field(default_factory=list)
    shm_removed: list[str] = field(default_factory=list)  # /dev/shm files only the cluster's processes had mapped
    temp_dir_removed: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_type_of(node: dict[str, Any], node_types: dict[str, NodeType]) -> str:
    """The type of a ``ray.nodes()`` entry: the head by its fixed id, a worker by its type's custom resources."""
    if node.get("NodeID") == FAKE_HEAD_NODE_ID:
        return "head"
    have = node.get("Resources") or {}
    for name, spec in node_types.items():
        custom = [r for r in spec.resources if r not in _STANDARD_RESOURCES]
        if custom and all(r in have for r in custom):
            return name
    return "unknown"


class LocalAutoscalingCluster:
    """``ray start --head`` with a fake multi-node autoscaler, isolated from every other Ray on the machine.

    ``node_types`` are the worker types (name -> :class:`NodeType`); the head declares ``head_resources``
    only. ``env`` is added to every cluster process's environment (the head's, and through the
    autoscaler the worker nodes' and all their workers'): Serve's ``RAY_SERVE_*`` flags go there.
    Use as a context manager, or call :meth:`start` and :meth:`teardown` (idempotent).
    """

    def __init__(
        self,
        node_types: dict[str, NodeType],
        *,
        head_resources: dict[str, float] | None = None,
        idle_timeout_minutes: float = 0.25,
        object_store_bytes: int = 100 * 1024 * 1024,
        env: dict[str, str] | None = None,
        keep_temp_dir: bool = False,
    ) -> None:
        self.node_types = node_types
        self.head_resources = dict(head_resources or {"CPU": 1})
        self.idle_timeout_minutes = idle_timeout_minutes
        self.object_store_bytes = object_store_bytes
        self.extra_env = dict(env or {})
        self.keep_temp_dir = keep_temp_dir
        self.temp_dir = Path(tempfile.mkdtemp(prefix="sa_ray_", dir="/tmp"))
        self.port = free_port()
        self.ip = _node_ip()
        self.proc: subprocess.Popen[bytes] | None = None
        self.report: TeardownReport | None = None

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def autoscaling_config(self) -> dict[str, Any]:
        """The cluster config the autoscaler reads (Ray ships no ``example.yaml`` for it in the wheel)."""
        types: dict[str, Any] = {
            HEAD_TYPE: {"resources": self.head_resources, "node_config": {}, "min_workers": 0, "max_workers": 0},
        }
        for name, spec in self.node_types.items():
            resources = {**spec.resources, "object_store_memory": self.object_store_bytes}
            types[name] = {"resources": resources, "node_config": {}, "min_workers": spec.min_workers, "max_workers": spec.max_workers}
        return {
            "cluster_name": self.temp_dir.name,
            "max_workers": sum(t.max_workers for t in self.node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                # Without it the provider's nodes join <this machine's IP>:6379: someone else's cluster.
                "gcs_address": self.address,
            },
            "available_node_types": types,
            "head_node_type": HEAD_TYPE,
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }

    def argv(self, config_path: Path) -> list[str]:
        head = dict(self.head_resources)
        argv = [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            f"--autoscaling-config={config_path}",
            f"--temp-dir={self.temp_dir}",
            f"--port={self.port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--node-manager-port=0", "--object-manager-port=0",
            "--min-worker-port=0", "--max-worker-port=0",  # OS-chosen ports, as the provider gives its nodes
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--object-store-memory={self.object_store_bytes}",
            f"--num-cpus={head.pop('CPU', 0)}",
            f"--num-gpus={head.pop('GPU', 0)}",
        ]
        if head:
            argv.append(f"--resources={json.dumps(head)}")
        return argv

    def environment(self) -> dict[str, str]:
        tmp = self.temp_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        return {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(tmp),  # vLLM's IPC sockets and any other temp file: removed with the temp dir
            **self.extra_env,
        }

    def start(self, timeout_s: float = 180) -> str:
        """Start the head (the autoscaler then launches each type's ``min_workers``); returns the address."""
        config_path = self.temp_dir / "autoscaling.json"
        config_path.write_text(json.dumps(self.autoscaling_config(), indent=1))
        log_path = self.temp_dir / "ray_start.log"
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv(config_path), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                start_new_session=True, cwd=os.getcwd(),
            )
        # The session id is the ray start pid (start_new_session): teardown finds the cluster by it.
        (self.temp_dir / STATE_FILE).write_text(json.dumps({"sid": self.proc.pid, "address": self.address}))
        deadline = time.monotonic() + timeout_s
        while b"Ray runtime started" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                self.teardown()
                raise RuntimeError(f"ray start did not come up (rc={self.proc.returncode}):\n{tail}")
            time.sleep(0.5)
        return self.address

    def log_lines(self, name: str, *needles: str) -> list[str]:
        """Lines of a log file of this cluster (e.g. ``monitor.log``: the autoscaler) holding any of ``needles``."""
        out: list[str] = []
        # session_latest is a link to the one session dir: read each file once
        for path in sorted({p.resolve() for p in self.temp_dir.glob(f"session_*/logs/{name}")}):
            for line in path.read_text(errors="replace").splitlines():
                if not needles or any(n in line for n in needles):
                    out.append(line)
        return out

    def save_logs(self, dest: Path, patterns: tuple[str, ...] = ("monitor.*", "serve/controller_*", "serve/replica_*")) -> int:
        """Copy this cluster's logs matching ``patterns`` (under the session's ``logs/``) to ``dest``, before
        teardown removes them; returns how many files."""
        n = 0
        for session in {p.resolve() for p in self.temp_dir.glob("session_*") if (p / "logs").is_dir()}:
            for pattern in patterns:
                for path in (session / "logs").glob(pattern):
                    target = dest / path.relative_to(session / "logs")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, target)
                    n += 1
        return n

    def teardown(self) -> TeardownReport:
        if self.report is None:
            self.report = teardown_cluster(self.temp_dir, keep_temp_dir=self.keep_temp_dir, ray_start=self.proc)
        return self.report

    def __enter__(self) -> LocalAutoscalingCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def _node_ip() -> str:
    """The address Ray itself picks for this machine (what the head's GCS and every node report)."""
    from ray._private.services import get_node_ip_address

    return str(get_node_ip_address())


def _sid(temp_dir: Path) -> int | None:
    try:
        return int(json.loads((temp_dir / STATE_FILE).read_text())["sid"])
    except (OSError, ValueError, KeyError):
        return None


def cluster_processes(temp_dir: Path, sid: int | None = None) -> list[Any]:
    """Live processes of the cluster in ``temp_dir``: in its session, naming the temp dir, or below either."""
    import psutil

    sid = _sid(temp_dir) if sid is None else sid
    needle = str(temp_dir)
    found: dict[int, Any] = {}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if (sid is not None and os.getsid(p.pid) == sid) or any(needle in a for a in p.info["cmdline"] or ()):
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    for p in list(found.values()):
        try:
            for child in p.children(recursive=True):
                if child.pid != os.getpid() and child.status() != psutil.STATUS_ZOMBIE:
                    found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return list(found.values())


def _describe(p: Any) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:160]}"
    except Exception:  # noqa: BLE001 - gone meanwhile
        return str(p.pid)


def _signal_all(procs: list[Any], sig: int) -> int:
    n = 0
    for p in procs:
        try:
            p.send_signal(sig)
            n += 1
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    return n


def _wait_gone(procs: list[Any], timeout_s: float) -> None:
    import psutil

    psutil.wait_procs(procs, timeout=timeout_s)


def teardown_cluster(
    temp_dir: Path | str, *, keep_temp_dir: bool = False, ray_start: subprocess.Popen[bytes] | None = None, timeout_s: float = 60
) -> TeardownReport:
    """End every process of the cluster in ``temp_dir`` and nothing else, then check that none is left.

    Works from any process that knows the temp dir (the session id is in its state file), so a test
    can clean up after a driver that was killed. Idempotent.
    """
    import psutil

    temp_dir = Path(temp_dir)
    t0 = time.monotonic()
    report = TeardownReport()
    sid = _sid(temp_dir)
    procs = cluster_processes(temp_dir, sid)
    report.found = len(procs)
    shm = _shm_files(procs)
    # 1. The autoscaler first, so that it launches no node while the others go.
    monitors = [p for p in procs if any("monitor.py" in a for a in _cmdline(p))]
    report.killed += _signal_all(monitors, signal.SIGKILL)
    _wait_gone(monitors, 5)
    # 2. ray start --block stops the head's processes on SIGTERM.
    if ray_start is not None and ray_start.poll() is None:
        ray_start.terminate()
        try:
            ray_start.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    # 3. Everything else: SIGTERM, then SIGKILL until a scan comes back empty.
    rest = cluster_processes(temp_dir, sid)
    report.terminated += _signal_all(rest, signal.SIGTERM)
    _wait_gone(rest, 10)
    deadline = time.monotonic() + timeout_s
    while (rest := cluster_processes(temp_dir, sid)) and time.monotonic() < deadline:
        report.killed += _signal_all(rest, signal.SIGKILL)
        _wait_gone(rest, 5)
    if ray_start is not None:
        try:
            ray_start.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(1)  # a process forked during the last scan shows up in this one
    report.left = [_describe(p) for p in cluster_processes(temp_dir, sid)]
    report.zombies = sum(1 for p in psutil.process_iter() if _is_zombie_of(p, sid))
    if not report.left:
        # Named semaphores and shared memory a SIGKILLed process could not unlink (multiprocessing's
        # sem.mp-*, vLLM's psm_*): mapped by the cluster's processes, by no process still running.
        still_mapped = _shm_files(list(psutil.process_iter()))
        for path in sorted(shm - still_mapped):
            try:
                os.unlink(path)
                report.shm_removed.append(path)
            except OSError:
                pass
    if not report.left and not keep_temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
        report.temp_dir_removed = not temp_dir.exists()
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def _shm_files(procs: list[Any]) -> set[str]:
    """Files under /dev/shm that ``procs`` have mapped and that still have a name."""
    out: set[str] = set()
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as fh:
                for line in fh:
                    path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                        out.add(path)
        except OSError:
            continue
    return out


def _cmdline(p: Any) -> list[str]:
    try:
        return list(p.cmdline())
    except Exception:  # noqa: BLE001 - gone meanwhile
        return []


def _is_zombie_of(p: Any, sid: int | None) -> bool:
    import psutil

    try:
        return sid is not None and p.status() == psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid
    except (psutil.Error, OSError):
        return False


@contextmanager
def local_autoscaling_cluster(node_types: dict[str, NodeType], **kwargs: Any) -> Iterator[LocalAutoscalingCluster]:
    """:class:`LocalAutoscalingCluster` as a context manager that always tears down."""
    cluster = LocalAutoscalingCluster(node_types, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.teardown()
