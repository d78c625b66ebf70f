"""The remote side: Ray (the cluster, the runners, ``trustrl serve``) and the external
agents' learner side (the inbox, the wire format). The only layer that imports Ray.

Nothing here imports Ray at module import time: ``import trustrl.remote`` stays
cheap, and Ray (the optional ``trustrl[ray]`` extra) is imported on first use.
"""

from __future__ import annotations

from trustrl.remote.cluster import (
    INSTALL_HINT,
    RayCluster,
    RayUnavailableError,
    create_actor,
    import_ray,
)

__all__ = ["INSTALL_HINT", "RayCluster", "RayUnavailableError", "create_actor", "import_ray"]
