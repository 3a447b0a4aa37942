"""`ragspec serve --executor ray --replicas N`: N Ray Serve replicas of the `ragspec serve` app behind Ray
Serve's HTTP proxy.

Each replica is the single-machine server (`ragspec.serve.app`) unchanged: it opens the index read-only, loads
its own model and keeps its own admission queue, so the API and every answer are the ones one process gives.
Ray Serve only spreads requests over the replicas (and restarts a replica that dies).
"""

from __future__ import annotations

from pathlib import Path

from ragspec.cluster import connect, require_ray

APP_NAME = "ragspec"
_started_ray = False  # this process started the local Ray instance that `stop()` then takes down


class Replica:
    """One replica: `build_server` in the constructor, its FastAPI app handed to Ray Serve afterwards."""

    def __init__(self, index: str, spec: dict, api_key: str | None):
        from ragspec.serve.app import build_server

        self.server = build_server(index, spec, api_key=api_key)

    def __serve_build_asgi_app__(self):
        from ragspec.serve.app import create_app

        return create_app(self.server)


def start(index: str | Path, spec, *, replicas: int, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, address: str | None = None, cpus_per_replica: float = 1.0) -> str:
    """Deploy `replicas` replicas over `index` with pipeline `spec` (a PipelineSpec) and return the proxy's URL.

    Connects to the cluster at `address` (or starts a local one). Returns once every replica has loaded its
    model; `stop()` takes the application down again.
    """
    from ragspec.errors import RagspecError

    require_ray()
    from ray import serve

    if replicas < 1:
        raise RagspecError(f"--replicas must be at least 1 (got {replicas})")
    global _started_ray
    _started_ray = connect(address) or _started_ray
    capacity = 1 + spec.serve.queue_size
    deployment = serve.deployment(
        serve.ingress()(Replica), name="ragspec", num_replicas=replicas,
        # ragspec's own admission answers 503 past its queue: let each replica see that many requests (+ probes)
        max_ongoing_requests=capacity + 4, ray_actor_options={"num_cpus": cpus_per_replica},
    )
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment.bind(str(index), spec.model_dump(), api_key), name=APP_NAME, route_prefix="/")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def stop() -> None:
    """Delete the ragspec application; stop Serve and Ray too when `start` started a local Ray (a cluster
    joined by address keeps running)."""
    global _started_ray
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    serve.delete(APP_NAME)
    if _started_ray:
        serve.shutdown()
        ray.shutdown()
        _started_ray = False
