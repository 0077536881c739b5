"""The replicas' notice board: a small named Ray actor per memfit application.

Ray Serve gives the ingress a handle to the deployment, not to each replica, so the replicas
push their stats and Prometheus text here every half second (memfit.ray.replica) and the
ingress reads them for /ray/replicas and /metrics. A replica that stops reporting (killed,
its node lost) is shown as stale after STALE_S and dropped after DROP_S; one that is stopped
by Serve (scale down) removes itself.
"""

from __future__ import annotations

import time

import ray

STALE_S = 3.0
DROP_S = 30.0
NAMESPACE = "memfit"


@ray.remote(num_cpus=0)
class Registry:
    def __init__(self):
        self.entries: dict[str, dict] = {}

    def report(self, replica: str, stats: dict, metrics: str) -> None:
        self.entries[replica] = {"stats": stats, "metrics": metrics, "t": time.time()}

    def forget(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def snapshot(self) -> dict:
        now = time.time()
        for k in [k for k, e in self.entries.items() if now - e["t"] > DROP_S]:
            del self.entries[k]
        return {k: dict(e, age_s=now - e["t"], live=now - e["t"] <= STALE_S)
                for k, e in self.entries.items()}


def registry_name(app_name: str) -> str:
    return f"memfit-registry-{app_name}"


def get_registry(app_name: str):
    """The application's registry actor, created by whoever asks first (detached: it lives
    until memfit.ray.shutdown removes it, whichever replica or ingress created it)."""
    return Registry.options(name=registry_name(app_name), namespace=NAMESPACE,
                            get_if_exists=True, lifetime="detached").remote()


def kill_registry(app_name: str) -> None:
    try:
        ray.kill(ray.get_actor(registry_name(app_name), namespace=NAMESPACE))
    except ValueError:  # never created
        pass
