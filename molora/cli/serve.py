"""`molora serve | bundle`: the server, with vLLM's flags for your own model and adapters."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from molora.cli.registry import command
from molora.config import (
    DEFAULT_MAX_ARRAY_ITEMS,
    DEFAULT_MAX_NUMBER_DIGITS,
    DEFAULT_MAX_OBJECT_PROPERTIES,
    DEFAULT_MAX_STRING_CHARS,
)
from molora.errors import MoLoRAError

# --------------------------------------------------------------------------------------------- serve


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle",
        action="append",
        default=[],
        metavar="DIR",
        help="bundle folder (default: the embedded default bundle); with --ray, repeat it to serve several",
    )
    _model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="[NAME=]KEY",
        help="accept this Bearer key (repeatable; also $MOLORA_API_KEYS, comma-separated); none: open. NAME=KEY "
        "names the key: its requests are tenant NAME (fair share, per-tenant limits and metrics)",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        default=[],
        metavar="KEY",
        help="key that may load/unload adapters (repeatable; also $MOLORA_ADMIN_KEYS)",
    )
    p.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="folder POST /v1/adapters may load from (repeatable; none: run-time loading off)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="engine requests in flight at most; more get 429")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine runs per step (default 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens one engine step computes at most, decodes first, then prompt chunks (default 512); a small "
        "budget keeps a step that starts requests near the cost of a decode step (vLLM's flag)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split a long prompt across steps under --max-num-batched-tokens (default on; "
        "--no-enable-chunked-prefill runs each prompt whole and needs a budget of at least --max-model-len)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of a prompt prefix computed before on the same adapters (default on; "
        "--no-enable-prefix-caching turns it off, as in vLLM)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding without a draft model, vLLM\'s flag: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (prompt lookup) or '
        '\'{"method": "suffix", ...}\'; greedy output stays the same, token for token (molora.engine.speculative)',
    )
    p.add_argument(
        "--admission",
        choices=("fcfs", "slots"),
        default="fcfs",
        help="order in which waiting requests start: fcfs (default), or slots: requests whose adapters are all in "
        "slots pass one that waits for a slot, at most 16 times each (molora.engine.scheduler)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority", "fair"),
        default="fcfs",
        help="who is admitted first: fcfs (default), priority (the request's priority field, lower first; vLLM's), "
        "or fair: a fair share per tenant by served tokens (molora.engine.policy)",
    )
    p.add_argument(
        "--tenant-max-queued",
        type=int,
        default=None,
        metavar="N",
        help="engine requests one tenant may have in flight (queued or running); more get 429 (default: no limit)",
    )
    p.add_argument(
        "--tenant-tokens-per-minute",
        type=int,
        default=None,
        metavar="N",
        help="prompt + completion tokens one tenant may use in any 60 s; more get 429 (default: no limit)",
    )
    p.add_argument(
        "--max-mix-weight",
        type=float,
        default=2.0,
        help="the largest |weight| a request may give an adapter in molora.mix, or a pinned adapter in molora.scale "
        "(default 2: a plain bound, twice the trained delta or its negation; EngineConfig.max_mix_weight)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a CUDA device, run every decode step eagerly (default: replay CUDA graphs)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument(
        "--dtype",
        type=_dtype,
        default="float32",
        metavar="float32|bfloat16",
        help="weights, adapters and KV cache (default float32; bfloat16 is faster on CPUs with "
        "avx512_bf16/AMX and on GPUs, outputs differ slightly; vLLM's auto and float mean float32)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        choices=("int8", "int4", "w8a8"),
        default=None,
        help="quantize the base model's linears on load, on the CPU (vLLM's flag): int8 weights per output "
        "channel, activations in --dtype (weight only); int4 weights in groups of 32 (weight only, slower); w8a8: "
        "int8 weights and activations quantized per token after SmoothQuant factors (torch._int_mm: on an "
        "AVX512-VNNI CPU without AMX 1.51x float32's engine throughput, docs/benchmarks.md); adapters stay in "
        '--dtype (default: the bundle\'s "quantization", else none)',
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        default=None,
        help="with --quantization int8 or w8a8: the LM head in int8 too, the tied embeddings read from its rows (one "
        "int8 copy, about 0.94x the Q8_0 GGUF's bytes for SmolLM2-135M; 6-11%% slower measured on a CPU without AMX: "
        "docs/benchmarks.md)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="default deadline of a request in seconds (default 600); molora.timeout overrides it",
    )
    p.add_argument(
        "--max-request-timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="the most molora.timeout may ask for (default 3600)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a request that has not started after this long ends with 503 (default 300; 0: never)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="/health turns 503 when the engine is busy this long without a step (default 30)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (vLLM\'s flag): the answer is parsed for tool calls by --tool-call-parser; without '
        'it, "auto" is refused (400) and "required" or a named function still work (grammar-enforced)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool_choice auto reads calls: hermes (<tool_call>{json}</tool_call>, the default) or json (the "
        "whole answer is a call or a list of calls); molora.server.tools.register_tool_parser adds more",
    )
    p.add_argument(
        "--max-json-string-chars",
        type=int,
        default=DEFAULT_MAX_STRING_CHARS,
        metavar="N",
        help=f"structured output: a string the schema leaves unbounded (no maxLength, pattern or format) closes at N "
        f"characters, so an answer that would repeat inside it ends (default {DEFAULT_MAX_STRING_CHARS}; 0: unbounded)",
    )
    p.add_argument(
        "--max-json-array-items",
        type=int,
        default=DEFAULT_MAX_ARRAY_ITEMS,
        metavar="N",
        help=f"structured output: an array without maxItems closes at N items (default {DEFAULT_MAX_ARRAY_ITEMS}; "
        "0: unbounded); a schema's own maxLength and maxItems always win",
    )
    p.add_argument(
        "--max-json-object-properties",
        type=int,
        default=DEFAULT_MAX_OBJECT_PROPERTIES or 0,
        metavar="N",
        help=f"structured output: an object open to properties it does not list (additionalProperties not false) "
        f"and without maxProperties closes at N properties, or its listed ones if more (default "
        f"{DEFAULT_MAX_OBJECT_PROPERTIES or 0}; 0: unbounded)",
    )
    p.add_argument(
        "--max-json-number-digits",
        type=int,
        default=DEFAULT_MAX_NUMBER_DIGITS or 0,
        metavar="N",
        help=f"structured output: a number the schema leaves unbounded gets at most N digits before its point (a "
        f"minimum / maximum of -/+ (10^N - 1), written without an exponent; default {DEFAULT_MAX_NUMBER_DIGITS or 0}; "
        "0: unbounded)",
    )
    p.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="read special-token literals typed in chat messages (<|im_end|>, ...) as special tokens; by default they "
        "are text, so a message cannot close its turn and write another (completions always keep them)",
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=15.0,
        metavar="S",
        help="SSE keep-alive comment interval while a stream waits (default 15)",
    )
    ray = p.add_argument_group("scale-out on Ray Serve (needs `pip install molora[ray]`)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: an ingress and engine replicas")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale between this ...")
    ray.add_argument("--max-replicas", type=int, default=None, help="... and this many replicas")
    ray.add_argument(
        "--ray-queue",
        type=int,
        default=None,
        help="calls that may wait for a replica before 429 (default: --max-queue)",
    )
    ray.add_argument(
        "--ray-ingress",
        choices=("serve", "process"),
        default="serve",
        help="where the HTTP app runs: a Serve deployment behind Ray's HTTP proxy (serve, default: Ray "
        "restarts and places it), or this process, calling the engine replicas through a handle "
        "(process: one Ray hop per token instead of two, no proxy)",
    )
    ray.add_argument(
        "--ray-placement",
        choices=("adapters", "bundle"),
        default="adapters",
        help="which replica runs a call: among those holding its bundle, the one whose hot set holds most of "
        "the adapters the call may use (adapters, default), or Ray's own choice by bundle alone (bundle)",
    )
    ray.add_argument(
        "--bundles-per-replica",
        type=int,
        default=2,
        help="bundles a replica keeps resident; Ray evicts the least recently used (default 2)",
    )
    ray.add_argument(
        "--threads-per-replica", type=int, default=None, help="torch threads per replica (default: cores / replicas)"
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for serving your own model and adapters (molora.userbundle); serve and bundle init share them."""
    from molora.routing.names import names_help

    own = p.add_argument_group("your own model and adapters (vLLM's flags)")
    own.add_argument(
        "--model",
        default=None,
        metavar="M",
        help="a transformers folder, a .gguf file or a model id in the local Hugging Face cache (nothing "
        "is downloaded); instead of --bundle",
    )
    own.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help='PEFT LoRA folders to serve: NAME=PATH or \'{"name": NAME, "path": PATH}\' (repeatable); '
        "a request with model=NAME pins that adapter",
    )
    own.add_argument(
        "--router",
        default=None,
        metavar="none|arrow|arrow-token|hybrid|DIR",
        help="what model=<the base name> runs: none (the base model, default); with no training data, hybrid "
        "(pick this one: validation skills mean 90.6 against 76.9 for arrow, 95%% of general prompts kept on the "
        "base: docs/datafree_hybrid_choice.json) or arrow; each name is the same router as `molora route|generate|"
        "eval --router NAME` and molora.routing NAME: "
        + names_help()
        + "; or a router folder from `molora train-router` (or per-adapter gates from `molora train-gates`)",
    )
    own.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the base's model id in the API (default: the --model value; the first name is used)",
    )
    own.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapter slots: adapters one step may mix (default: max(4, adapters given))",
    )
    own.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="the largest adapter rank the slots hold (default: the largest given, at least 8)",
    )
    own.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters kept in CPU memory beyond the slots (default: up to 1 GiB of them)",
    )
    own.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file or the text) instead of the tokenizer's",
    )
    own.add_argument(
        "--lora-resolver-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a request naming an unknown model NAME loads the PEFT folder DIR/NAME on first use "
        "(vLLM's filesystem resolver; also $VLLM_LORA_RESOLVER_CACHE_DIR); repeatable",
    )
    own.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="every PEFT subfolder DIR/NAME is adapter NAME from the start, listed by /v1/models; only its "
        "adapter_config.json is read until a request needs it; repeatable",
    )
    own.add_argument(
        "--enable-lora", action="store_true", help="accepted for vLLM compatibility; molora always serves adapters"
    )


def _dtype(value: str) -> str:
    """--dtype: float32 or bfloat16, with vLLM's spellings (auto, float, bf16)."""
    v = {"auto": "float32", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(value, value)
    if v not in ("float32", "bfloat16"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: molora runs float32 or bfloat16 (also auto/float = float32); "
            "float16 is not supported, use bfloat16"
        )
    return v


def own_bundle(args: argparse.Namespace) -> object | None:
    """The in-memory bundle of the --model flags (None when --model is not given; then they must be unused)."""
    from molora.userbundle import FlagError, bundle_from_flags

    if args.model is None:
        used = [
            f
            for f, v in (
                ("--lora-modules", args.lora_modules),
                ("--router", args.router),
                ("--served-model-name", args.served_model_name),
                ("--max-loras", args.max_loras),
                ("--max-lora-rank", args.max_lora_rank),
                ("--chat-template", args.chat_template),
            )
            if v
        ]
        if used:
            raise FlagError(
                f"{', '.join(used)} need --model M (your base model's folder); without --model molora "
                "serves a bundle (--bundle DIR, default: the embedded one)"
            )
        return None
    if getattr(args, "bundle", None):
        raise FlagError(
            f"--model {args.model} and --bundle {args.bundle[0]} both given; serve one: a bundle "
            "folder names its own base model"
        )
    return bundle_from_flags(args.model, args.lora_modules, **_manifest_flags(args))


def _manifest_flags(args: argparse.Namespace) -> dict:
    """The `--model` flags' values as `molora.userbundle.manifest_from_flags` takes them (serve and bundle init)."""
    return dict(
        router=args.router,
        served_model_name=(args.served_model_name or [None])[0],
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        chat_template=args.chat_template,
    )


def _env_list(name: str) -> list[str]:
    """A comma-separated environment variable's entries (none when unset)."""
    return [k for k in os.environ.get(name, "").split(",") if k]


@command("serve", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible API (model=<base> runs the base or its router; model=ADAPTER pins one adapter)."""
    from molora.engine import EngineConfig
    from molora.engine.speculative import SpeculativeConfig
    from molora.server import serve
    from molora.server.generation import Limits

    speculative = SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None
    limits = Limits(
        request_timeout_s=args.request_timeout,
        max_request_timeout_s=args.max_request_timeout,
        queue_timeout_s=args.queue_timeout or None,
        keepalive_s=args.keepalive,
    )
    from molora.server.tenants import TenantLimits

    keys = dict(
        api_keys=args.api_key + _env_list("MOLORA_API_KEYS"),
        admin_keys=args.admin_key + _env_list("MOLORA_ADMIN_KEYS"),
        tenant_limits=TenantLimits(args.tenant_max_queued, args.tenant_tokens_per_minute),
    )
    import logging

    # the hybrid chooser's calibration (minutes at a first start) says what it is doing even without --verbose
    logging.getLogger("molora.calibration").setLevel(logging.INFO)
    bundle = own_bundle(args)
    if args.ray and args.router == "hybrid":
        raise MoLoRAError(
            "--router hybrid is served without --ray for now (its chooser runs beside one in-process engine); "
            "drop --ray, or use --router arrow on Ray"
        )
    if args.ray and args.enable_auto_tool_choice:
        raise MoLoRAError(
            "--enable-auto-tool-choice is served without --ray for now; drop --ray (tool_choice required or "
            "named works on Ray too)"
        )
    if args.ray:
        if bundle is not None:  # replicas load bundles from folders: the flags' manifest, written to a temp folder
            import tempfile

            from molora.userbundle import write_bundle

            folder = Path(tempfile.mkdtemp(prefix="molora-bundle-"))
            write_bundle(folder, bundle.manifest)
            args.bundle = [str(folder)]
        return _serve_ray(args, limits, keys, speculative)
    if len(args.bundle) > 1:
        raise MoLoRAError(
            f"{len(args.bundle)} bundles given; one server process serves one bundle: add --ray to serve several"
        )
    if bundle is None and args.bundle:
        bundle = args.bundle[0]
    serve(
        bundle,
        host=args.host,
        port=args.port,
        adapter_roots=args.adapter_root,
        max_queue=args.max_queue,
        drain_timeout_s=args.drain_timeout,
        dtype=args.dtype,
        engine_config=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching,
            admission=args.admission,
            scheduling_policy=args.scheduling_policy,
            max_mix_weight=args.max_mix_weight,
            speculative=speculative,
        ),
        limits=limits,
        stall_s=args.stall_timeout,
        max_cpu_loras=args.max_cpu_loras,
        lora_resolver_dirs=args.lora_resolver_dir + _env_list("VLLM_LORA_RESOLVER_CACHE_DIR"),
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        lora_dirs=args.lora_dir,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
        max_json_string_chars=args.max_json_string_chars,
        max_json_array_items=args.max_json_array_items,
        max_json_object_properties=args.max_json_object_properties,
        max_json_number_digits=args.max_json_number_digits,
        **keys,
    )
    return 0


def _serve_ray(args: argparse.Namespace, limits: object, keys: dict, speculative: object = None) -> int:
    try:
        import ray  # noqa: F401

        from molora.server import ray_serve
    except ImportError as e:
        raise MoLoRAError(f"--ray needs Ray Serve: pip install 'molora[ray]' ({e})") from None
    cfg = ray_serve.RayConfig(
        bundles=tuple(args.bundle) or (None,),
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        max_queue=args.max_queue,
        ray_queue=args.ray_queue,
        bundles_per_replica=args.bundles_per_replica,
        threads_per_replica=args.threads_per_replica,
        engine_config={
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_chunked_prefill": args.enable_chunked_prefill,
            "enforce_eager": args.enforce_eager,
            "enable_prefix_caching": args.enable_prefix_caching,
            "admission": args.admission,
            "scheduling_policy": args.scheduling_policy,
            "max_mix_weight": args.max_mix_weight,
            "speculative": speculative,
        },
        dtype=args.dtype,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        stall_s=args.stall_timeout,
        ingress=args.ray_ingress,
        placement=args.ray_placement,
        lora_dirs=tuple(args.lora_dir),
    )
    from molora.engine import EngineConfig

    EngineConfig(**cfg.engine_config)  # bad engine flags are refused here, not inside every replica
    ray_serve.serve_ray(
        cfg,
        host=args.host,
        port=args.port,
        adapter_roots=args.adapter_root,
        server_kwargs={
            "limits": limits,
            "lora_resolver_dirs": args.lora_resolver_dir + _env_list("VLLM_LORA_RESOLVER_CACHE_DIR"),
            **keys,
        },
    )
    return 0


# --------------------------------------------------------------------------------------------- bundle


def _bundle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["init", "check"],
        help="init: write molora.json from --model/--lora-modules; check: say what is wrong with DIR",
    )
    p.add_argument("dir", nargs="?", default=None, help="check: the bundle folder")
    p.add_argument("--out", default=None, metavar="DIR", help="init: the folder to write molora.json into")
    _model_flags(p)


@command("bundle", _bundle_args)
def _bundle(args: argparse.Namespace) -> int:
    """Write a bundle for your own model and adapters (init), or check one file by file (check)."""
    from molora.userbundle import FlagError, check_bundle, describe, manifest_from_flags, write_bundle

    if args.action == "check":
        if not args.dir:
            raise FlagError("molora bundle check DIR: give the bundle folder")
        problems = check_bundle(args.dir)
        for line in problems:
            print(f"problem: {line}")
        if problems:
            return 1
        from molora.bundle import read_bundle

        print(f"ok: {describe(read_bundle(args.dir))}")
        return 0
    if not args.out or not args.model:
        raise FlagError("molora bundle init needs --model M and --out DIR (and --lora-modules NAME=PATH ...)")
    manifest = manifest_from_flags(args.model, args.lora_modules, **_manifest_flags(args))
    path = write_bundle(args.out, manifest)
    print(
        f"wrote {path}; check it with `molora bundle check {args.out}`, train a router with `molora train-router "
        f"--bundle {args.out} --data NAME=FILE ...`, serve it with `molora serve --bundle {args.out}`"
    )
    return 0
