"""Builds the Serve application: an Ingress in front of engine replicas (the generation
backbone's EngineReplica and, unless `encoder: false`, the EncoderReplica for Classify/Embed),
and the MetricsHub they all report to (server/metrics/hub.py). In direct mode (setting
`direct`, server/direct_settings.py) there is no EngineReplica deployment: the Ingress's
replicas run the generation engine themselves (server/direct.py).

    from ray import serve
    serve.run(build_app({"model": "/models/llama", "engine": {"device": "cuda"}}))

As a Serve config (deploy/serve_config.yaml):

    applications:
      - name: adapterserve
        import_path: adapterserve.server.app:app_builder
        args: {model: /models/llama, store: s3://bucket/adapters}
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from adapterserve.config import EngineConfig
from adapterserve.server.direct import DirectIngress
from adapterserve.server.direct_settings import runs_direct
from adapterserve.server.engine_process.placement import replica_placement
from adapterserve.server.ingress import Ingress
from adapterserve.server.limits import check_server_limits, engine_max_ongoing
from adapterserve.server.metrics.hub import MetricsHub, hub_options
from adapterserve.server.replica import EngineReplica
from adapterserve.server.routing import AdapterAffinityRouter
from adapterserve.server.routing_settings import Routing, routing_of
from adapterserve.server.settings import merge_config, replica_actor_options, resolve_paths


def build_app(config: Mapping[str, Any] | None = None) -> Application:
    """The application for `config` (overrides of settings.DEFAULTS); ValueError on bad settings."""
    cfg = resolve_paths(merge_config(config))
    engine = EngineConfig(**cfg["engine"])  # refuse bad engine settings here, not in every replica
    check_server_limits(cfg)
    drain = _drain_options(cfg)
    options = {**_replica_options(cfg, "replica"), "max_ongoing_requests": engine_max_ongoing(cfg, engine),
               **_router_options(routing_of(cfg["routing"], engine.max_num_seqs))}
    direct = runs_direct(cfg)
    hub = MetricsHub.options(**hub_options()).bind(cfg)  # every replica reports to it; scrapes read it
    encoder = None
    if cfg["encoder"]:
        EngineConfig(**cfg["encoder_engine"])
        encoder_options = _replica_options(cfg, "encoder_replica")
        encoder = EngineReplica.options(name="EncoderReplica", **encoder_options, **drain).bind(cfg, "encoder", hub)
    if direct:  # one deployment: the ingress's replicas own the generation engine (direct.py)
        return DirectIngress.options(name="Ingress", **_direct_options(cfg, options), **drain).bind(cfg, encoder, hub)
    replica = EngineReplica.options(name="EngineReplica", **options, **drain).bind(cfg, "model", hub)
    return Ingress.options(name="Ingress", **cfg["ingress"], **drain).bind(replica, cfg, encoder, hub)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for a Serve config's `import_path`; `args` are the config overrides."""
    return build_app(args)


def _drain_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Serve's stop of a replica (scale-down, upgrade, shutdown) lets its requests finish for drain_grace_s
    (range-checked with the other limits: check_server_limits)."""
    return {"graceful_shutdown_timeout_s": float(cfg["drain_grace_s"]), "graceful_shutdown_wait_loop_s": 0.5}


def _direct_options(cfg: Mapping[str, Any], engine_options: Mapping[str, Any]) -> dict[str, Any]:
    """The direct deployment's Serve options: the engine replica's (replica count or autoscaling,
    actor options, tensor-parallel placement, health checks), no request router (nothing to
    route between), and room for every call the ingress's admission admits, so admission sheds
    with its own message before Serve queues (limits.py)."""
    options = {k: v for k, v in engine_options.items() if k != "request_router_config"}
    ingress = cfg["ingress"]
    options["max_ongoing_requests"] = max(options["max_ongoing_requests"], ingress["max_ongoing_requests"])
    options["max_queued_requests"] = max(options["max_queued_requests"], ingress["max_queued_requests"])
    return options


def _router_options(routing: Routing) -> dict[str, Any]:
    """The generation deployment's request router: adapter affinity, or Serve's default (pow2)."""
    if not routing.by_adapter:
        return {}
    router = RequestRouterConfig(request_router_class=AdapterAffinityRouter,
                                 request_router_kwargs={"spill_queue_depth": routing.spill_queue_depth})
    return {"request_router_config": router}


def _replica_options(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    opts = {k: v for k, v in cfg[key].items() if k != "ray_actor_options"}
    if opts.get("autoscaling_config"):
        opts["num_replicas"] = "auto"  # Serve: autoscaling replaces a fixed count
    else:
        opts.pop("autoscaling_config", None)
    actor = replica_actor_options(cfg) if key == "replica" else dict(cfg[key]["ray_actor_options"] or {})
    placement = replica_placement(cfg["engine"], actor) if key == "replica" else {}  # tensor parallel: N bundles
    return {**opts, "ray_actor_options": actor, **placement}
