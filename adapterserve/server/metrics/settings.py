"""The `metrics` settings (settings.DEFAULTS), checked before anything starts."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HTTP_ROUTE = ("public", "full", "off")


def check_metrics(metrics: Mapping[str, Any]) -> None:
    """ValueError naming the first bad `metrics.*` value."""
    if metrics["http_route"] not in HTTP_ROUTE:
        raise ValueError(f"metrics.http_route must be one of {', '.join(HTTP_ROUTE)}, got {metrics['http_route']!r}")
    port = metrics["port"]
    if port is not None and (not _is_int(port) or not 1 <= port <= 65535):
        raise ValueError(f"metrics.port must be a port number (1-65535) or null, got {port!r}")
    if not isinstance(metrics["host"], str) or not metrics["host"]:
        raise ValueError(f"metrics.host must be an address to listen on, e.g. 0.0.0.0, got {metrics['host']!r}")
    if not _is_int(metrics["adapter_labels"]) or not 0 <= metrics["adapter_labels"] <= 1000:
        raise ValueError("metrics.adapter_labels must be a whole number from 0 to 1000 (adapters named in the "
                         f"adapter label), got {metrics['adapter_labels']!r}")
    for key, most in (("push_interval_s", 60.0), ("label_refresh_s", 86400.0)):
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
            raise ValueError(f"metrics.{key} must be a number of seconds above 0 and at most {most:g}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stale_after_s(metrics: Mapping[str, Any]) -> float:
    """How long a replica's gauges count after its latest report (a few missed reports are forgiven)."""
    return max(5.0, 5 * float(metrics["push_interval_s"]))
