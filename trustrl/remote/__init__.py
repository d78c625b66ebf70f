"""The remote side: Ray (the cluster, the runners, ``trustrl serve``) and the external
agents' learner side (the inbox, the wire format, the gateway). The only layer that
imports Ray or grpcio.

* ``cluster.py``: the Ray instance of a run (``RayCluster``), ``import_ray``, and
  ``create_actor``, through which every actor is made;
* ``runners.py``: ``RayRunners``, the collector in Ray actors;
* ``wire.py``: what travels between an agent and its learner (chunks, snapshots) and how
  it is checked; no Ray, no torch (the agent client imports it);
* ``inbox.py``: ``Inbox``, where chunks arrive and are spooled and the newest policy
  waits; no Ray;
* ``external.py``: ``ExternalRunner`` (the learner's ``Runner`` over an inbox), packing,
  the spaces and settings of a learner for external agents;
* ``serve.py``: ``trustrl serve``, the inbox as a named Ray actor, and ``RayLink``, an
  agent's way to it;
* ``gateway.py``: ``trustrl serve --listen``, the gRPC gateway in front of the inbox
  (``proto/`` its schema, ``messages.py`` its messages, ``thin.py`` thin chunks,
  ``credentials.py`` the agents' tokens), and ``grpc_link.py``, an agent's way to it
  (grpcio, no Ray, no torch).

Nothing here imports Ray at module import time: ``import trustrl.remote`` stays
cheap, and Ray (the optional ``trustrl[ray]`` extra) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trustrl.remote.cluster import (
        INSTALL_HINT,
        RayCluster,
        RayUnavailableError,
        create_actor,
        import_ray,
    )

__all__ = ["INSTALL_HINT", "RayCluster", "RayUnavailableError", "create_actor", "import_ray"]


def __getattr__(name: str) -> Any:
    """cluster.py's names, imported on first use: the agent client imports wire.py from
    this package and needs none of them (nor cluster.py's urllib and ssl)."""
    if name in __all__:
        from trustrl.remote import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
