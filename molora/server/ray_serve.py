"""Scale-out on Ray Serve: `molora serve --ray`. With `molora.server.ray_router` and `molora.server.ray_deployments`
(the deployment classes), the only modules that import ray (the `molora[ray]` extra).

    molora serve --ray --replicas 2 [--bundle A --bundle B] [--min-replicas 1 --max-replicas 4]
                 [--ray-placement adapters|bundle]

Two tiers (../docs/scaleout.md says why, with what was measured):

- **Ingress**: the same FastAPI app as `molora serve` (`build_app`), over a `RayClient` instead of the
  in-process `LocalClient`, so validation, errors, SSE, `return_routing`, API keys and metrics are one code
  path. It tokenises, checks and formats; it owns the adapter `Registry`. `--ray-ingress serve` (default) makes
  it a Serve deployment (one replica) behind Ray's HTTP proxy, which Ray restarts and places. `--ray-ingress
  process` runs it under uvicorn in the `molora serve --ray` process, calling the engine deployment through a
  handle: one Ray hop per streamed chunk instead of two, no proxy or ingress actor.
- **Engine replicas** (`--replicas N`, or autoscaled): each is one molora engine per resident bundle (one
  process, its own slot bank, KV cache and tiers) behind `@serve.multiplexed`. The multiplexed model id is the
  **bundle**, never the adapter: per-token routing may pick any adapter of the bundle at any token, so the whole
  bundle must be resident where the request runs (`model="bundle:adapter"` maps to the bundle's id too).
  Repeats of a bundle go to a replica that holds it; a bundle spills to another replica only when its
  holders are at `max_ongoing_requests` (set to the engine's admission limit, `--max-queue`).
- **Placement by adapter set** (`molora.server.ray_router.AdapterSetRouter`, the deployment's request router):
  among the replicas that hold the bundle, a call goes to the one whose hot set holds most of the adapters it
  needs (its pinned adapter, or the adapters its routing may pick), unless that replica is overloaded; each
  replica reports its hot sets through `record_routing_stats` every second (`molora.server.placement`).
  `--ray-placement bundle` keeps Ray's default router (the bundle alone decides).

Bundle leases (`Leases`): Ray's per-replica LRU evicts a bundle by dropping the object the loader returned,
calling its `__del__` (twice: Serve, then garbage collection) even while a stream of that bundle runs. So an
eviction only marks the lease; the engine is stopped and freed when the last sequence using it ends, a second
release is a no-op, and a request that arrives for a bundle being released gets the same engine back without a
reload.

Adapters at run time (`Registry`): POST/DELETE `/v1/adapters` change the ingress's registry, which gives the
bundle a new *version*: the bundle's adapter set (name -> folder) and which removals are forced. Every request
carries its bundle's current version; a replica whose engine is behind brings its bank up to date (loads what
is new, unloads what went: draining, or forced) before it runs the request. A POST first applies the new version
on one replica, which reads and checks the files; the version counts only if that worked (bad files are a 400
and nothing changes). So every replica serves exactly the registry's adapters from the first request it sees
after a change, replicas that Ray starts later included, which a broadcast could not promise (Serve has no
"every replica" call, and replicas come and go with autoscaling). `GET /v1/models` and `/v1/adapters` answer
from the registry: the same whichever replica would run the request. Adapter folders must be readable at the
same path on every replica's machine (one machine, or shared storage).

Saturation: the ingress's handle queues at most `max_queued_requests` (`--ray-queue`) calls beyond what the
replicas run; past that Ray raises `BackPressureError` and the client answers 429 with Retry-After. A replica
whose engine admission is full answers the same way.

Core molora never imports this module; ray is imported inside the functions that need it (and the deployment
classes live in molora.server.ray_deployments, which imports ray), so the plain parts (registry, leases, the replica
logic, the client over any handle) run and are tested without a Ray cluster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molora.errors import MoLoRAError
from molora.server.ray_client import RayClient
from molora.server.ray_state import BundleSpec, Registry

log = logging.getLogger("molora.server.ray")

ENGINE_DEPLOYMENT = "MoloraEngine"
INGRESS_DEPLOYMENT = "MoloraIngress"
APP_NAME = "molora"
INGRESS_KINDS = ("serve", "process")
PLACEMENTS = ("adapters", "bundle")


# ------------------------------------------------------------------------------------------ Ray deployments


@dataclass(frozen=True)
class RayConfig:
    """What `molora serve --ray` deploys (CLI flags of the same names)."""

    bundles: tuple[str | None, ...] = (None,)  # bundle folders (None: the embedded default)
    replicas: int = 1
    min_replicas: int | None = None  # autoscaling bounds (both or neither)
    max_replicas: int | None = None
    max_queue: int = 64  # engine requests a replica admits = max_ongoing_requests
    ray_queue: int | None = None  # calls queued at the ingress beyond that (None: max_queue)
    bundles_per_replica: int = 2  # Ray's max_num_models_per_replica
    threads_per_replica: int | None = None  # torch threads (None: cores / replicas)
    cpus_per_replica: float | None = None  # Ray's num_cpus (None: threads_per_replica)
    engine_config: dict = field(default_factory=dict)
    dtype: str = "float32"
    quantization: str | None = None  # vLLM's --quantization: each replica's engines quantize the base on load
    quantize_lm_head: bool | None = None  # --quantize-lm-head: the LM head in int8 too (None: attach's default)
    stall_s: float = 30.0
    ingress: str = "serve"  # "serve": a Serve deployment; "process": in this process
    placement: str = "adapters"  # "adapters": AdapterSetRouter; "bundle": Ray's default router (by bundle only)
    lora_dirs: tuple[str, ...] = ()  # --lora-dir: every bundle's replicas register these folders' adapters cold

    def __post_init__(self) -> None:
        if self.ingress not in INGRESS_KINDS:
            raise MoLoRAError(f"--ray-ingress {self.ingress!r}: use one of {', '.join(INGRESS_KINDS)}")
        if self.quantization not in (None, "int8", "int4", "w8a8"):  # molora.ops.quant.SCHEMES
            raise MoLoRAError(f"--quantization {self.quantization!r}: use int8, int4 or w8a8 (or leave it out)")
        if self.quantize_lm_head and self.quantization not in ("int8", "w8a8"):  # quant_linear.HEAD_CAPABLE
            raise MoLoRAError(f"--quantize-lm-head needs --quantization int8 or w8a8, got {self.quantization!r}")
        if self.placement not in PLACEMENTS:
            raise MoLoRAError(f"--ray-placement {self.placement!r}: use one of {', '.join(PLACEMENTS)}")
        if self.replicas < 1 or self.max_queue < 1 or self.bundles_per_replica < 1:
            raise MoLoRAError(
                f"--replicas ({self.replicas}), --max-queue ({self.max_queue}) and bundles per "
                f"replica ({self.bundles_per_replica}) must be at least 1"
            )
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise MoLoRAError("give both --min-replicas and --max-replicas for autoscaling, or neither")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise MoLoRAError(f"need 0 < --min-replicas ({self.min_replicas}) <= --max-replicas ({self.max_replicas})")
        if not self.bundles:
            raise MoLoRAError("--ray needs at least one bundle")

    @property
    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, (os.cpu_count() or 1) // (self.max_replicas or self.replicas))


def bundle_specs(
    bundles: Sequence[str | None], roots: Sequence[str | Path] = (), lora_dirs: Sequence[str | Path] = ()
) -> list[BundleSpec]:
    """Version-0 specs of the bundles: each with its manifest's adapters, and every PEFT subfolder of `lora_dirs`
    as a cold adapter (`BundleSpec.cold`: replicas register it without reading its weights; only which folders
    exist is read here). MoLoRAError where a --lora-dir name is a bundle's own adapter."""
    from molora.bundle import default_bundle_dir, read_bundle
    from molora.server.launch import scan_lora_dirs

    extra = {name: str(path) for _root, found in scan_lora_dirs(lora_dirs) for name, path in found.items()}
    specs = []
    for path in bundles:
        b = read_bundle(default_bundle_dir() if path is None else path)
        own = {a.name: None for a in b.adapters}
        if b.router_kind == "hybrid":
            raise MoLoRAError(
                f"bundle {b.name!r}: its hybrid chooser (router kind hybrid) is served without --ray for now; "
                "serve it with `molora serve --bundle DIR`, or give it router kind arrow for Ray"
            )
        clash = sorted(set(own) & set(extra))
        if clash:
            raise MoLoRAError(f"--lora-dir adapters {clash[:8]} have the names of bundle {b.name!r}'s own; rename them")
        specs.append(
            BundleSpec(
                b.name,
                None if path is None else str(Path(path).resolve()),
                adapters={**own, **extra},
                roots=tuple(str(Path(r).resolve()) for r in roots),
                routed=b.router_kind != "none",
                cold=frozenset(extra),
            )
        )
    return specs


def build_catalog(specs: Sequence[BundleSpec], *, max_model_len: int, default_max_tokens: int = 512) -> Any:
    """The ingress's `Catalog`: each bundle's tokenizer and manifest, without loading any model weights."""
    from molora.bundle import default_bundle_dir, load_tokenizer, read_bundle, with_tokenizer
    from molora.server.app import model_info
    from molora.server.generation import Catalog

    infos = []
    for s in specs:
        b = read_bundle(default_bundle_dir() if s.path is None else s.path)
        tok, config = load_tokenizer(b.base)
        b = with_tokenizer(b, tok)  # what the replicas' `load` fills in: the chat template, the prompt template, stops
        infos.append(
            model_info(
                s.name,
                tok,
                b,
                config=config,
                max_model_len=max_model_len,
                adapters=list(s.adapters),
                default_max_tokens=default_max_tokens,
            )
        )
    return Catalog(infos)


def engine_deployment(cfg: RayConfig, specs: Sequence[BundleSpec]) -> Any:
    """The engine deployment (molora.server.ray_deployments.EngineDeployment, multiplexed over
    cfg.bundles_per_replica bundles) with cfg's options, bound: its replicas each run one engine per resident
    bundle."""
    from ray import serve

    from molora.server.ray_deployments import engine_class

    scaling: dict[str, Any] = {"num_replicas": cfg.replicas}
    if cfg.min_replicas is not None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": cfg.min_replicas,
                "max_replicas": cfg.max_replicas,
                "target_ongoing_requests": max(1, cfg.max_queue // 2),
            }
        }
    deployment = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        max_ongoing_requests=cfg.max_queue,
        max_queued_requests=cfg.ray_queue or cfg.max_queue,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica or cfg.threads},
        **router_config(cfg.placement),
        **scaling,
    )(engine_class(cfg.bundles_per_replica))
    return deployment.bind(cfg, list(specs))


def router_config(placement: str) -> dict:
    """The engine deployment's request router options for `--ray-placement` (none: Ray's default router)."""
    if placement == "bundle":
        return {}
    from ray.serve.config import RequestRouterConfig

    from molora.server.ray_router import STATS_PERIOD_S, AdapterSetRouter

    config = RequestRouterConfig(
        request_router_class=AdapterSetRouter,
        request_routing_stats_period_s=STATS_PERIOD_S,
        request_routing_stats_timeout_s=10 * STATS_PERIOD_S,
    )
    return {"request_router_config": config}


def ingress_app(handle: Any, cfg: RayConfig, specs: Sequence[BundleSpec], server_kwargs: dict) -> Any:
    """The FastAPI app of `molora serve` over a `RayClient` on `handle` (the engine deployment)."""
    from molora.server.app import build_app

    catalog = build_catalog(specs, max_model_len=cfg.engine_config.get("max_model_len", 2048))
    client = RayClient(handle, Registry(specs), max_in_flight=cfg.max_queue)
    return build_app(client, catalog, **server_kwargs)


def make_app(cfg: RayConfig, specs: Sequence[BundleSpec], server_kwargs: dict) -> Any:
    """The Ray Serve application of `--ingress serve`: the ingress deployment
    (molora.server.ray_deployments.IngressDeployment) bound to the engine deployment (`serve.run` it)."""
    from ray import serve

    from molora.server.ray_deployments import IngressDeployment

    # the ingress only parses, tokenises and streams: it must take every call the engines could run or queue (Ray's
    # default of 5 ongoing requests per replica would hold the rest at the proxy, unbounded and unrefused)
    ongoing = max(1024, 2 * ((cfg.max_replicas or cfg.replicas) * cfg.max_queue + (cfg.ray_queue or cfg.max_queue)))
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": 0}
    )(IngressDeployment)
    return ingress.bind(engine_deployment(cfg, specs), cfg, list(specs), server_kwargs)


def serve_ray(
    cfg: RayConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    adapter_roots: Sequence[str] = (),
    server_kwargs: dict | None = None,
    block: bool = True,
) -> Any:
    """Start Ray (local), deploy the engine replicas and the ingress on host:port, and (block=True) serve until
    SIGTERM/Ctrl-C, then shut Serve and Ray down.

    cfg.ingress "serve": the app is a Serve deployment behind Ray's HTTP proxy; block=False returns its handle.
    cfg.ingress "process": the app runs under uvicorn in this process and calls the engine deployment through
    a handle, with no proxy (one hop per streamed chunk instead of two); block=False returns the app (serve it
    with `molora.server.launch.ServerThread`)."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    specs = bundle_specs(cfg.bundles, adapter_roots, cfg.lora_dirs)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    kwargs = {"adapter_roots": list(adapter_roots), **(server_kwargs or {})}
    if cfg.ingress == "process":
        serve.start(proxy_location="Disabled")
        engine = serve.run(engine_deployment(cfg, specs), name=APP_NAME, route_prefix=None)
        app = ingress_app(engine, cfg, specs, kwargs)
        if not block:
            return app
        from molora.server.launch import run_app

        log.info("serving %s on http://%s:%d/v1 (engine replicas on Ray Serve)", [s.name for s in specs], host, port)
        try:
            run_app(app, host, port, drain_timeout_s=None)
        finally:
            shutdown()
        return None
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(make_app(cfg, specs, kwargs), name=APP_NAME, route_prefix="/")
    log.info("serving %s through Ray Serve on http://%s:%d/v1", [s.name for s in specs], host, port)
    if not block:
        return handle
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        shutdown()
    return None


def shutdown() -> None:
    """Stop Serve and this process's Ray (every replica and Ray process it started)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
