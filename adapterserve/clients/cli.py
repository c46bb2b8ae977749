"""`adapterserve` command line: serve, upload, list, delete, generate, classify, embed, info.

    adapterserve serve                                  # embedded default: local Ray, tiny Llama + MiniLM
    adapterserve classify --adapter sentiment "a wonderful film"   # positive 0.9674
    adapterserve embed "a wonderful film"               # 384 dims: [0.0123, ...]
    adapterserve upload ./my-lora --name sql            # prints sql@1
    adapterserve generate --adapter sql --max-tokens 32 "SELECT"
    adapterserve list
    cat reviews.txt | adapterserve classify --adapter sentiment -   # '-': one text per line of stdin

Client commands read --server / $ADAPTERSERVE_SERVER, --api-key / $ADAPTERSERVE_API_KEY and
--timeout / $ADAPTERSERVE_TIMEOUT (seconds a call may take, default 600).
`serve` drains on SIGTERM or SIGINT (Ctrl-C): new requests are refused while running ones get
--grace-period seconds to finish, then everything it started stops; a second signal stops at once.
Exit status: 0 done, 1 the server refused or failed (or a second signal stopped `serve` at once),
2 bad arguments, a port already in use or a local check failed, 141 the reader of stdout went
away (`adapterserve generate ... | head -1`), as for a command killed by SIGPIPE.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from adapterserve import __version__
from adapterserve.clients.client import Client, default_server, seconds
from adapterserve.clients.local_check import check_locally
from adapterserve.clients.types import ClientError

if TYPE_CHECKING:
    from adapterserve.server.launch import Endpoints


STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a command its pipe's reader left


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see above)."""
    try:
        try:
            return _run(_parser().parse_args(argv))
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
    except BrokenPipeError:
        return _stdout_closed()


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except BrokenPipeError:
        raise
    except ClientError as e:
        hint = "; allow more with --timeout SECONDS" if e.code is grpc.StatusCode.DEADLINE_EXCEEDED else ""
        print(f"error: {e.code.name}: {e.details}{hint}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # local checks: AdapterError, RequestError, missing files
        print(f"error: {e}", file=sys.stderr)
        return 2


def _stdout_closed() -> int:
    """Stop quietly: stdout's reader is gone, so nothing more can be shown."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
    except (OSError, ValueError):
        pass  # stdout is no file (redirected in-process)
    return STDOUT_CLOSED


def _parser() -> argparse.ArgumentParser:
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--server", default=None, help="host:port (default $ADAPTERSERVE_SERVER or localhost:50051)")
    client.add_argument("--api-key", default=None, help="API key (default $ADAPTERSERVE_API_KEY)")
    client.add_argument("--timeout", type=_seconds_arg, metavar="SECONDS",
                        help="deadline of the call (default $ADAPTERSERVE_TIMEOUT or 600)")
    parser = argparse.ArgumentParser(prog="adapterserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start the server (local Ray unless --ray-address)")
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: a tiny random Llama)")
    p.add_argument("--encoder", help="BERT-family checkpoint for classify/embed (default: all-MiniLM-L6-v2 "
                   "with the example adapters sentiment and topic)")
    p.add_argument("--no-encoder", action="store_true", help="serve generation only (no encoder deployment)")
    p.add_argument("--store", help="adapter store: a directory or s3://bucket/prefix (default ~/.adapterserve/store)")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics (every series, private adapter "
                   "names and tenants included: for operators) on a port of its own, on --host; GET /metrics "
                   "on --http-port shows the public series (docs/observability.md)")
    p.add_argument("--replica-grpc-port", type=int, help="direct mode, one replica: the replica also serves gRPC on "
                   "this port, on --host, without HAProxy's hop (setting replica_grpc; docs/serving.md)")
    p.add_argument("--replica-grpc-workers", type=int, help="with --replica-grpc-port: this many front worker "
                   "processes share that port and forward each call to the replica (setting replica_grpc.workers)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the HTTP and gRPC ports (Serve's "
                   "own gRPC ports bind all interfaces: docs/serving.md)")
    p.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    p.add_argument("--direct", choices=["auto", "on", "off"], help="on: the engine inside the ingress "
                   "deployment (one hop per request); off: behind it, routed by adapter; auto (default): on "
                   "with one replica (docs/serving.md)")
    p.add_argument("--api-keys", help="a tenants file (YAML: keys with scopes, quotas) or a file of 'KEY TENANT' "
                   "lines (docs/tenancy.md); without it the server is open")
    p.add_argument("--device", help="engine device, e.g. cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "fp8"], help="engine dtype; fp8: "
                   "float8 linear weights of a Llama-family decoder, per-channel scales, bfloat16 elsewhere")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="fp8: keys and values in float8 e4m3 with a "
                   "scale per token and KV head, about half the cache's bytes (GPUs of compute capability 8.9+; "
                   "docs/serving.md)")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--tensor-parallel-size", type=int, metavar="N", help="split the backbone over N GPUs, one "
                   "engine replica driving N-1 workers placed by Ray on the replica's node (default 1; "
                   "docs/tensor_parallel.md)")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every kernel variant at engine start "
                   "(development: the first requests then wait for the compiler)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for /v1/chat/completions "
                   "(default: the tokenizer's own)")
    p.add_argument("--config", help="YAML/JSON file of config overrides (adapterserve.server.settings.DEFAULTS)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--grace-period", type=_grace_arg, metavar="SECONDS", help="on SIGTERM/SIGINT, how long "
                   "running requests may take to finish (default: config drain_grace_s, 30)")
    p.set_defaults(run=_serve)

    p = sub.add_parser("upload", parents=[client], help="validate and upload an adapter directory")
    p.add_argument("directory", help="the adapter's directory, or s3://bucket/prefix for the server to fetch")
    p.add_argument("--name", required=True)
    p.add_argument("--http-url", help="the server's HTTP address, for s3:// (default $ADAPTERSERVE_HTTP_URL "
                   "or port 8000 of --server's host)")
    p.add_argument("--public", action="store_true", help="let every tenant use it")
    p.add_argument("--no-validate", action="store_true", help="skip the local check of sizes and file names "
                   "(and, with adapterserve[engine] installed, of the adapter itself, as the server checks it; "
                   "without torch only sizes and names are checked here); the server checks anyway")
    p.set_defaults(run=_upload)

    p = sub.add_parser("list", parents=[client], help="list the adapters you can use, and your tenant's usage")
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_list)

    p = sub.add_parser("delete", parents=[client], help="delete NAME@VERSION, or every version of NAME")
    p.add_argument("ref")
    p.set_defaults(run=_delete)

    p = sub.add_parser("info", parents=[client], help="show the served backbone, limits and your tenant's usage")
    p.set_defaults(run=_info)

    p = sub.add_parser("generate", parents=[client], help="generate text, streamed to stdout")
    p.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin (less one final newline)")
    p.add_argument("--prompt-token-ids", help="comma-separated token ids instead of PROMPT")
    p.add_argument("--adapter", help="NAME or NAME@VERSION (default: the base model)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--presence-penalty", type=float, help="[-2, 2]: less likely to repeat any generated token")
    p.add_argument("--frequency-penalty", type=float, help="[-2, 2]: less likely the more a token was generated")
    p.add_argument("--repetition-penalty", type=float, help="> 0, 1 = off: tokens of the prompt and output")
    p.add_argument("--n", type=int, help="completions of the prompt, each printed on a line of its own once done "
                                         "(with --json: all under \"choices\")")
    p.add_argument("--json", action="store_true", help="print one JSON object with token_ids, text, finish_reason")
    p.set_defaults(run=_generate)

    p = sub.add_parser("classify", parents=[client], help="label texts with an adapter's classification head")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="- reads texts from stdin, one per line")
    p.add_argument("--adapter", required=True, help="NAME or NAME@VERSION of an adapter with a head")
    p.add_argument("--json", action="store_true", help="print one JSON object per text")
    p.set_defaults(run=_classify)

    p = sub.add_parser("embed", parents=[client], help="sentence vectors from the encoder")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="- reads texts from stdin, one per line")
    p.add_argument("--adapter", help="NAME or NAME@VERSION (default: the base encoder)")
    p.add_argument("--json", action="store_true", help="print one JSON list of floats per text")
    p.set_defaults(run=_embed)
    return parser


def _client(args: argparse.Namespace) -> Client:
    return Client(args.server or default_server(), args.api_key or os.environ.get("ADAPTERSERVE_API_KEY"),
                  timeout=args.timeout)


def _seconds_arg(text: str) -> float:
    try:
        return seconds(text, "the value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _grace_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"the value must be a number of seconds >= 0, got {text!r}")
    return value


# serve


def _serve(args: argparse.Namespace) -> int:
    try:
        from adapterserve.server import serve_command
        from adapterserve.server.settings import merge_config
    except ModuleNotFoundError as e:  # a client-only install
        print(f"error: {e}; serving needs pip install 'adapterserve[serve]'", file=sys.stderr)
        return 2

    config = serve_config(args)
    return serve_command.run(config, merge_config(config)["drain_grace_s"], lambda e: _announce(args, e),
                             host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                             ray_address=args.ray_address)


def _announce(args: argparse.Namespace, endpoints: Endpoints) -> None:
    print(f"adapterserve is serving: gRPC {endpoints.grpc}, HTTP {endpoints.http}/v1  (Ctrl-C stops)", flush=True)
    if endpoints.metrics:
        print(f"  metrics: {endpoints.metrics} (every series: keep this port private)", flush=True)
    if endpoints.replica_grpc:
        print(f"  gRPC straight to the replica: {endpoints.replica_grpc}", flush=True)
    if not args.api_keys:
        print("  open mode (no --api-keys): anyone who reaches this machine may use and change adapters; "
              "Serve's gRPC ports listen on all interfaces", flush=True)
    print(f"  try: adapterserve generate --server {endpoints.grpc} --max-tokens 16 \"Hello\"", flush=True)
    if not args.no_encoder:
        print(f"       adapterserve classify --server {endpoints.grpc} --adapter sentiment \"a wonderful film\"",
              flush=True)


def serve_config(args: argparse.Namespace) -> dict:
    """The config overrides `serve`'s flags ask for (a --config file first, flags on top)."""
    config: dict = _read_config_file(args.config) if args.config else {}
    engine = dict(config.get("engine", {}))
    for flag, key in (("device", "device"), ("dtype", "dtype"), ("kv_cache_dtype", "kv_cache_dtype"),
                      ("max_lora_rank", "max_lora_rank"), ("tensor_parallel_size", "tensor_parallel_size")):
        if getattr(args, flag) is not None:
            engine[key] = getattr(args, flag)
    if getattr(args, "no_warmup", False):
        engine["warmup"] = False
    if engine:
        config["engine"] = engine
    for flag, key in (("model", "model"), ("store", "store"), ("api_keys", "api_keys_file"),
                      ("chat_template", "chat_template")):
        if getattr(args, flag):
            config[key] = getattr(args, flag)
    if args.no_encoder and args.encoder:
        raise ValueError("give --encoder or --no-encoder, not both")
    if args.encoder or args.no_encoder:
        config["encoder"] = False if args.no_encoder else args.encoder
    if args.replicas is not None:
        config["replica"] = {**config.get("replica", {}), "num_replicas": args.replicas}
    if getattr(args, "direct", None) is not None:
        config["direct"] = {"auto": "auto", "on": True, "off": False}[args.direct]
    if args.grace_period is not None:
        config["drain_grace_s"] = args.grace_period
    if args.metrics_port is not None:
        config["metrics"] = {**config.get("metrics", {}), "port": args.metrics_port, "host": args.host}
    if args.replica_grpc_port is not None:
        config["replica_grpc"] = {**config.get("replica_grpc", {}), "port": args.replica_grpc_port, "host": args.host}
    if args.replica_grpc_workers is not None:
        config["replica_grpc"] = {**config.get("replica_grpc", {}), "workers": args.replica_grpc_workers}
    return config


def _read_config_file(path: str) -> dict:
    import yaml

    with open(path) as f:
        loaded = yaml.safe_load(f) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a mapping of config keys")
    return loaded


# adapters


def _upload(args: argparse.Namespace) -> int:
    if args.directory.startswith("s3://"):
        return _upload_by_reference(args)
    from adapterserve.clients.upload_stream import collect_files

    with _client(args) as client:
        files = collect_files(args.directory)
        if not args.no_validate:
            check_locally(client, args.directory, args.name, [(f.path, f.size) for f in files])
        with _progress_bar(files) as bar:
            info = client.upload(args.directory, args.name, public=args.public, progress=bar.update)
    print(info.ref)
    return 0


def _upload_by_reference(args: argparse.Namespace) -> int:
    """The server fetches s3://... itself (through its HTTP route: clients/by_reference.py)."""
    from adapterserve.clients.by_reference import LoadRefused, http_url, load_by_reference
    from adapterserve.clients.client import deadline_s

    base = http_url(args.http_url, args.server or default_server())
    api_key = args.api_key or os.environ.get("ADAPTERSERVE_API_KEY")
    try:
        loaded = load_by_reference(base, args.directory, args.name, api_key=api_key, public=args.public,
                                   timeout=deadline_s(args.timeout))
    except LoadRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(loaded["id"])
    return 0


def _progress_bar(files):
    from tqdm import tqdm

    return tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc="upload", file=sys.stderr,
                disable=None, leave=False)


def _list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        listing = client.listing(args.name)
        adapters = listing.adapters
        if args.name and not adapters:  # none of that name: NOT_FOUND with the server's hint
            adapters = [client.get_adapter(args.name)]
    if args.json:
        print(json.dumps([a.__dict__ for a in adapters], indent=1))
        return 0
    admin = bool(listing.tenants)
    owner = f" {'OWNER':<16}" if admin else ""
    print(f"{'ADAPTER':<32} {'KIND':<14} {'RANK':>4} {'BYTES':>10}  {'PUBLIC':<6}{owner} CREATED")
    for a in adapters:
        public = "yes" if a.public else "no"
        owner = f" {a.tenant or '-':<16}" if admin else ""
        print(f"{a.ref:<32} {a.kind:<14} {a.rank:>4} {a.size_bytes:>10}  {public:<6}{owner} {a.created_at}")
    if not args.name and listing.usage.tenant:  # the whole list: then the key's tenant and its usage
        _print_usage([listing.usage, *(t for t in listing.tenants if t.tenant != listing.usage.tenant)])
    return 0


def _print_usage(tenants: list) -> None:
    """One line per tenant: scopes, then each use against its quota."""
    print(f"{'TENANT':<20} {'SCOPES':<20} {'BYTES':>21} {'ADAPTERS':>11} {'TOKENS/MIN':>19} {'IN FLIGHT':>11}")
    for t in tenants:
        q = t.quotas
        print(f"{t.tenant:<20} {','.join(t.scopes) or '-':<20} {_of(t.bytes_stored, q['bytes_stored']):>21} "
              f"{_of(t.adapters, q['adapters']):>11} {_of(t.tokens_last_minute, q['tokens_per_minute']):>19} "
              f"{_of(t.requests_in_flight, q['concurrent_requests']):>11}")


def _of(used: int, limit: int | None) -> str:
    return f"{used}/{limit}" if limit is not None else f"{used}"


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for ref in client.delete_adapter(args.ref):
            print(f"deleted {ref}")
    return 0


def _info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(dataclasses.asdict(client.server_info()), indent=1))
    return 0


# generation


def _generate(args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    sampling = {"adapter": args.adapter, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "stop": args.stop,
                "ignore_eos": args.ignore_eos, "presence_penalty": args.presence_penalty,
                "frequency_penalty": args.frequency_penalty, "repetition_penalty": args.repetition_penalty,
                "n": args.n}
    with _client(args) as client:
        if args.json:
            print(json.dumps(client.generate(prompt, **sampling).to_json()))
            return 0
        if (args.n or 1) > 1:
            for choice in client.generate(prompt, **sampling).choices:
                print(choice.text)
            return 0
        for chunk in client.stream(prompt, **sampling):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# encoder tasks


def _classify(args: argparse.Namespace) -> int:
    texts = _texts(args.texts)
    with _client(args) as client:
        results = client.classify(texts, args.adapter)
    for text, r in zip(texts, results):
        print(json.dumps({"text": text, **r.to_json()}) if args.json else f"{r.label}\t{r.probability:.4f}\t{text}")
    return 0


def _embed(args: argparse.Namespace) -> int:
    texts = _texts(args.texts)
    with _client(args) as client:
        vectors = client.embed(texts, args.adapter)
    for text, v in zip(texts, vectors):
        preview = ", ".join(f"{x:.4f}" for x in v[:4])
        print(json.dumps(v) if args.json else f"{len(v)} dims: [{preview}, ...]\t{text}")
    return 0


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ValueError("give either PROMPT or --prompt-token-ids (not both)")
    if args.prompt == "-":
        return _prompt_from_stdin()
    if args.prompt is not None:
        return args.prompt
    text = args.prompt_token_ids
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None


def _prompt_from_stdin() -> str:
    text = _read_stdin()
    text = text.removesuffix("\n")  # `echo PROMPT |` adds one
    if not text:
        raise ValueError("PROMPT is - but stdin held no text")
    return text


def _texts(given: Sequence[str]) -> list[str]:
    """TEXT arguments with a '-' replaced by stdin's non-blank lines."""
    if given.count("-") > 1:
        raise ValueError("give - (stdin) as TEXT once")
    texts = []
    for text in given:
        texts += [line for line in _read_stdin().splitlines() if line.strip()] if text == "-" else [text]
    if not texts:
        raise ValueError("TEXT is - but stdin held no text (one text per line)")
    return texts


def _read_stdin() -> str:
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not {e.encoding} text: {e.reason} at byte {e.start}") from None


if __name__ == "__main__":
    sys.exit(main())
