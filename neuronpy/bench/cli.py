"""`neuronpy bench`: its flags (`add_parser`) and what it does (`run`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from neuronpy.bench.config import BenchConfig, quick_config
from neuronpy.bench.systems import PEER_HELP, PEERS
from neuronpy.bench.workloads import WORKLOADS
from neuronpy.defaults import DTYPES, QUANTIZE_MODES

DESCRIPTION = (
    "Measure neuronpy against its peers on the same model, prompts, dtype and device: W1 "
    "closed loop at K streams, W2 Poisson arrivals, W3 burst, W4 a long prompt joining, W5 "
    "structured outputs, W6 speculation. Prints a table; writes a JSON file and a PNG plot of "
    "tokens/s against K. The workloads, metrics and peers: docs/benchmarks.md in neuronpy's "
    "repository."
)


def add_parser(subparsers: Any) -> None:
    """Adds the `bench` subcommand to a `neuronpy` argparse subparsers object."""
    parser = subparsers.add_parser(
        "bench", help="benchmark neuronpy against its peers", description=DESCRIPTION
    )
    add_arguments(parser)


def _number_list(kind: type[int] | type[float], name: str) -> Any:
    """An argparse type: positive numbers of `kind`, separated by commas."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {name} separated by commas, got {text!r}"
            ) from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive {name}, got {text!r}")
        return values

    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def _workloads(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "all":
        return WORKLOADS
    names = tuple(v.strip().upper() for v in text.split(",") if v.strip())
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"workloads are {', '.join(WORKLOADS)} or all; got {text!r}"
        )
    return names


def _peers(text: str) -> tuple[str, ...]:
    value = text.strip().lower()
    if value == "all":
        return PEERS
    if value == "none":
        return ()
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"peers are {', '.join(PEERS)}, all or none; got {text!r}")
    return tuple(p for p in PEERS if p in names)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    peers = "; ".join(f"{name}: {text}" for name, text in PEER_HELP.items())
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help="a local directory, a .gguf file or a hub id "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights dtype for every system (default auto: bfloat16 on a CPU with avx512_bf16 "
        "or AMX, else float32)",
    )
    model.add_argument(
        "--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)"
    )
    model.add_argument(
        "--quantize",
        default=None,
        choices=QUANTIZE_MODES,
        metavar="MODE",
        help="neuronpy's weight mode, e.g. int8 (the peers stay in --dtype)",
    )
    model.add_argument(
        "--chunk-steps",
        type=float,
        default=None,
        metavar="S",
        help="neuronpy's [engine] chunk_steps: decode steps' time a joining prompt's chunk "
        "may add to a step (default 0.5)",
    )
    model.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split neuronpy's model over N ranks (processes on this machine); the run adds "
        "neuronpy-1-device, the same engine on one device, beside it",
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--workloads",
        type=_workloads,
        default=None,
        metavar="W1,W2,..",
        help="workloads to run, or all (default W1)",
    )
    what.add_argument(
        "--k",
        type=_int_list,
        default=None,
        metavar="1,2,4,..",
        help="W1's concurrent streams (default 1,2,4,8,16)",
    )
    what.add_argument(
        "--prompt-len",
        type=_positive,
        default=None,
        metavar="N",
        help="W1 (and W4 decoders') prompt tokens (default 128)",
    )
    what.add_argument(
        "--output-len",
        type=_positive,
        default=None,
        metavar="N",
        help="W1 output tokens, EOS ignored (default 128)",
    )
    what.add_argument(
        "--repeats",
        type=_positive,
        default=None,
        metavar="N",
        help="runs per point; the median run is reported (default 3)",
    )
    what.add_argument(
        "--peers",
        type=_peers,
        default=None,
        metavar="LIST",
        help=f"peers to run beside neuronpy: all (default), none, or a list of: {peers}",
    )
    what.add_argument(
        "--max-in-flight",
        type=_positive,
        default=None,
        metavar="K",
        help="neuronpy's batch rows, and the static batch width outside W1 "
        "(default: the largest K; at least 8 with W2-W4)",
    )
    what.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: K=1,2, prompt 32, output 16, one repeat, small W2-W4",
    )
    what.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the synthetic prompts and arrivals (default 0)",
    )
    embed = parser.add_argument_group("embeddings (instead of the generation workloads)")
    embed.add_argument(
        "--embeddings",
        action="store_true",
        help="measure embedding throughput: neuronpy's engine against transformers' own "
        "forward of the same weights, in this process (no peers, no HTTP)",
    )
    embed.add_argument(
        "--embed-batches",
        type=_int_list,
        default=None,
        metavar="B1,B2,..",
        help="inputs per call (default 1,2,4,8,16,32,64)",
    )
    embed.add_argument(
        "--embed-len",
        default="128",
        metavar="N|LO-HI",
        help="tokens per input: N, or each drawn in LO-HI (padding for transformers; default 128)",
    )
    mixed = parser.add_argument_group("W2-W4")
    mixed.add_argument(
        "--w2-load",
        type=_float_list,
        default=None,
        metavar="0.25,..",
        help="W2 arrival rates as shares of W1's peak tokens/s (default 0.25,0.5,0.75,0.9)",
    )
    mixed.add_argument(
        "--requests",
        type=_positive,
        default=None,
        metavar="N",
        help="requests in W2 and W3 (default 32)",
    )
    mixed.add_argument(
        "--long-prompt",
        type=_positive,
        default=None,
        metavar="N",
        help="W4's joining prompt tokens (default 2000)",
    )
    drive = parser.add_argument_group("how neuronpy is driven")
    drive.add_argument(
        "--drive",
        choices=["engine", "http"],
        default=None,
        help="engine: the Python API in-process (default); http: a server, streamed (SSE)",
    )
    drive.add_argument(
        "--url",
        default=None,
        help="a running neuronpy server to measure (implies --drive http; it must serve --model)",
    )
    out = parser.add_argument_group("output")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative",
        choices=("ngram",),
        help="also run neuronpy with speculative decoding (neuronpy-spec), side by side with "
        "neuronpy: its tokens/s over neuronpy's, its drafts' acceptance (W6 is the workload "
        "it is for; W1 shows what it costs where drafts do not pay)",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="neuronpy-spec's most drafts per row and step (default: the engine's)",
    )
    out.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        metavar="DIR",
        help="where the JSON and PNG go (default bench-results/)",
    )
    out.add_argument("--no-plot", action="store_true", help="skip the PNG")


def run_embeddings(args: argparse.Namespace) -> int:
    """`neuronpy bench --embeddings` (neuronpy/bench/embeddings.py): the table, and its JSON
    under --out."""
    from neuronpy.bench import embeddings, report
    from neuronpy.errors import ModelLoadError

    _quiet_transformers()
    dtype = "float32" if args.dtype == "auto" else args.dtype
    try:
        results = embeddings.run_embedding_bench(
            args.model,
            dtype=dtype,
            quantize=args.quantize or "none",
            batches=args.embed_batches or embeddings.DEFAULT_BATCHES,
            lengths=args.embed_len,
            repeats=args.repeats or 3,
        )
    except (ValueError, ModelLoadError) as exc:
        print(f"neuronpy bench: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(embeddings.format_table(results))
    stem = report.output_stem(args.out)
    path = embeddings.write_json(results, stem.with_name(f"{stem.name}-embeddings.json"))
    print(f"\nresults: {path}")
    return 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig: --quick's sizes (or the defaults) with the given flags on top."""

    base = quick_config() if args.quick else BenchConfig()
    drive = args.drive or ("http" if args.url else "engine")
    if args.url and drive != "http":
        raise ValueError("--url measures a server: it needs --drive http")
    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "quantize": args.quantize,
        "chunk_steps": args.chunk_steps,
        "tensor_parallel": args.tensor_parallel,
        "workloads": args.workloads,
        "ks": args.k,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "peers": args.peers,
        "max_in_flight": args.max_in_flight,
        "seed": args.seed,
        "w2_loads": args.w2_load,
        "requests": args.requests,
        "long_prompt": args.long_prompt,
        "drive": drive,
        "url": args.url,
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Runs `neuronpy bench`; 0 on success, 2 for bad flags, 1 if the benchmark failed."""
    from neuronpy.bench import report
    from neuronpy.bench.runner import run_bench
    from neuronpy.errors import ModelLoadError

    if args.embeddings:
        return run_embeddings(args)

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"neuronpy bench: error: {exc}", file=sys.stderr)
        return 2
    _quiet_transformers()
    if argv is None:
        argv = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "bench" else sys.argv[1:]
    try:
        results = run_bench(config, argv=argv)
    except (ValueError, ModelLoadError) as exc:
        print(f"neuronpy bench: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(report.format_report(results))
    stem = report.output_stem(args.out)
    path = report.write_json(results, stem.with_suffix(".json"))
    print(f"\nresults: {path}")
    if not args.no_plot:
        _, message = report.plot_throughput(results, stem.with_suffix(".png"))
        print(message)
    return 0
