"""Scale-out on Ray: the Ray instance a run uses, and the actors that host its runners.

Nothing here imports Ray at module import time: ``import trustrl.distributed`` stays
cheap, and Ray (the optional ``trustrl[ray]`` extra) is imported on first use.
"""

from __future__ import annotations

from trustrl.distributed.cluster import (
    INSTALL_HINT,
    RayCluster,
    RayUnavailableError,
    create_actors,
    import_ray,
)

__all__ = ["INSTALL_HINT", "RayCluster", "RayUnavailableError", "create_actors", "import_ray"]
