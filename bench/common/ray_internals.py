"""Every use of Ray's private API in the benchmarks, in one place (``ray._private``, ``ray.serve._private``,
the Serve controller client): what public API does not tell a benchmark. A Ray upgrade that moves any
of it breaks this module only. Ray is imported inside each function: a bench that needs none of it
does not pay for the import.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
from typing import Any

SERVE_FLAGS = {  # result key -> ray.serve._private.constants name (read at import time by each Serve process)
    "direct_ingress": "RAY_SERVE_ENABLE_DIRECT_INGRESS",
    "ha_proxy": "RAY_SERVE_ENABLE_HA_PROXY",
    "grpc_between_deployments": "RAY_SERVE_USE_GRPC_BY_DEFAULT",
    "user_code_in_separate_thread": "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "router_in_separate_loop": "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
}


def serve_flags(*keys: str) -> dict[str, Any]:
    """Serve's flags as this process read them, by ``SERVE_FLAGS`` key (all of them when none is named)."""
    from ray.serve._private import constants

    return {k: getattr(constants, SERVE_FLAGS[k]) for k in keys or SERVE_FLAGS}


def haproxy_replicas_up() -> int:
    """Ingress replicas HAProxy has marked UP (until then it answers through its fallback Serve proxy)."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH
    from ray.serve._private.haproxy import HAProxyApi

    best = 0
    for sock_path in glob.glob(os.path.join(os.path.dirname(RAY_SERVE_HAPROXY_SOCKET_PATH), "*", "admin.sock")):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(5.0)
                client.connect(sock_path)
                client.sendall(b"show stat\n")
                data = b""
                while chunk := client.recv(65536):
                    data += chunk
        except OSError:
            continue  # a stale socket from an earlier run
        stats = HAProxyApi._parse_haproxy_csv_stats(data.decode(errors="replace"))
        up = sum(1 for servers in stats.values() for name, srv in servers.items() if name.startswith("SERVE_REPLICA") and srv.is_up)
        best = max(best, up)
    return best


def direct_ingress_ports(app_name: str) -> list[int]:
    """HTTP ports the ingress replicas of ``app_name`` listen on themselves (direct ingress / HAProxy modes)."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    groups = ray.get(controller.get_target_groups.remote(app_name, from_proxy_manager=True))
    ports = []
    for group in groups:
        if group.protocol == RequestProtocol.HTTP:
            ports += [t.port for t in group.targets]
    return sorted(set(ports))


def deploy_apps(config: dict[str, Any]) -> None:
    """Deploy a ``serve deploy`` config (``{"applications": [...]}``) on the connected cluster, as the CLI does."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def gcs_actors() -> dict[str, dict[str, Any]]:
    """The GCS actor table (``State``, ``Pid``, ``Name``, ``ActorClassName``...); the state API would need
    the dashboard, which the benches do not start."""
    from ray._private import state

    return dict(state.actors())


class HashRing:
    """Serve's consistent-hash ring for one deployment, built without a cluster: Ray's own
    ``ConsistentHashRouter`` (``_rebuild_ring``, ``_lookup_ranked_replicas``: mmh3, its seed, vnode
    keys ``f"{unique_id}:{i}"``), and replica ids from Ray's own generator."""

    def __init__(self, deployment: str, app_name: str, router_kwargs: dict[str, Any]) -> None:
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID
        from ray.serve._private.constants import SERVE_LOGGER_NAME
        from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

        logging.getLogger(SERVE_LOGGER_NAME).setLevel(logging.WARNING)  # one INFO line per ring rebuild
        self.deployment_id = DeploymentID(name=deployment, app_name=app_name)
        self.router = ConsistentHashRouter(deployment_id=self.deployment_id, handle_source=DeploymentHandleSource.UNKNOWN)
        self.router.initialize_state(**router_kwargs)

    def new_replica_id(self) -> Any:
        """A replica id as Serve makes one (``get_random_string`` draws from the global ``random``)."""
        from ray.serve._private.common import ReplicaID
        from ray.serve._private.utils import get_random_string

        return ReplicaID(get_random_string(), deployment_id=self.deployment_id)

    def owners(self, replicas: list[Any], keys: list[str]) -> list[Any]:
        """The replica each key routes to first when ``replicas`` are the running ones."""
        self.router._rebuild_ring(frozenset(replicas))
        return [self.router._lookup_ranked_replicas(k)[0] for k in keys]
