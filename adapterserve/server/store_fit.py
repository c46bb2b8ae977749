"""Whether the adapter store fits the cluster, and what a crash left behind at start."""
from __future__ import annotations

import logging
from pathlib import Path

from adapterserve.adapters_store.store import AdapterStore
from adapterserve.server.uploads import remove_stale_uploads

logger = logging.getLogger("adapterserve.server")


def alive_nodes() -> int:
    """Nodes of the Ray cluster this process belongs to (1 when Ray is not running)."""
    import ray

    if not ray.is_initialized():
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def check_store_fits(store: AdapterStore, nodes: int) -> None:
    """A store in a local directory serves one machine: refuse it on a multi-node cluster."""
    from adapterserve.adapters_store.local import LocalStore

    if isinstance(store, LocalStore) and nodes > 1:
        raise ValueError(
            f"the adapter store {str(store.root)!r} is a local directory, but this Ray cluster has {nodes} "
            "nodes: replicas on other nodes would not find its adapters. Use an S3 store shared by every "
            "node (--store s3://bucket/prefix; docs/scaling.md, 'Stores')"
        )


def clean_crash_leftovers(store: AdapterStore, grace_s: float, upload_parent: str | Path | None = None) -> None:
    """Remove upload folders (in `upload_parent`, default the system temp folder) and store staging
    that a crashed server left, untouched for `grace_s`."""
    try:
        removed = remove_stale_uploads(grace_s, upload_parent)
        store.clean_staging(grace_s=grace_s)
    except Exception:  # a cleanup fault must not stop the server
        logger.exception("removing what interrupted uploads left failed; it is retried at the next start")
        return
    if removed:
        logger.info("removed %d upload folders that interrupted uploads left", removed)
