"""ragspec past one machine, on Ray: `indexing` (Ray Data chunk-and-embed stage) and `serving` (Ray Serve replicas).

Only this package imports `ray`, and only the `ray` extra installs it: `pip install 'ragspec[ray]'`.
"""

from __future__ import annotations

from ragspec.errors import RagspecError


def require_ray():
    """`ray`, or one line saying how to get it."""
    try:
        import ray
    except ImportError:
        raise RagspecError("--executor ray needs Ray: pip install 'ragspec[ray]'") from None
    return ray


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address` ('auto', 'ray://host:10001', …) or start a local one; True when this call
    started Ray (so the caller shuts it down again)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address:
        kwargs["address"] = address
    elif num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local Ray instance"
        raise RagspecError(f"could not connect to {where}: {str(exc).splitlines()[0]}") from None
    return True
