"""Which systems a run measures, built from its config on weights loaded once: neuronpy first
(in-process or over HTTP), then the selected peers in the order of PEERS."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuronpy.bench.config import BenchConfig, Progress
from neuronpy.bench.systems import (
    HF_CB,
    HF_SERIAL,
    HF_STATIC,
    NEURONPY,
    NEURONPY_EAGER,
    NEURONPY_ONE_DEVICE,
    NEURONPY_SERIAL,
    NEURONPY_SPEC,
    PEERS,
    System,
)
from neuronpy.bench.systems.hf_batching import HfContinuousBatching
from neuronpy.bench.systems.hf_generate import HfGenerate
from neuronpy.bench.systems.neuronpy_engine import NeuronpyEngine, engine_label
from neuronpy.bench.systems.neuronpy_server import NeuronpyHttp
from neuronpy.bench.threads import in_fresh_thread
from neuronpy.bench.workloads import WORKLOADS
from neuronpy.config import EngineConfig

if TYPE_CHECKING:
    from neuronpy.engine.engine import Engine

# neuronpy-serial's workloads: W4's join needs a batch to join
SERIAL_WORKLOADS = frozenset({"W1", "W2", "W3", "W5"})


@dataclass(frozen=True)
class Weights:
    """The model every system runs: transformers' model and tokenizer, loaded once."""

    hf_model: Any
    tokenizer: Any
    name: str
    source: str = ""


def load_weights(config: BenchConfig, progress: Progress) -> Weights:
    from neuronpy.loading import load_pretrained

    # in a thread of its own, so that its OpenMP team does not outlive it (see threads.py)
    loaded = in_fresh_thread(
        lambda: load_pretrained(
            config.model, dtype=config.dtype, device=config.device, log=progress.write
        )
    )
    return Weights(loaded.hf_model, loaded.tokenizer, loaded.name, loaded.source)


def engine_config(
    config: BenchConfig,
    max_in_flight: int,
    max_queue: int,
    speculative: bool = False,
    compile: str = "auto",
) -> EngineConfig:
    """neuronpy's engine settings for one of its systems: the run's, with these on top."""
    options: dict[str, Any] = {"max_in_flight": max_in_flight, "max_queue": max_queue}
    if compile != "auto":
        options["compile"] = compile
    if speculative:
        options["speculative"] = config.speculative
        if config.num_speculative_tokens is not None:
            options["num_speculative_tokens"] = config.num_speculative_tokens
    if config.quantize not in (None, "none"):
        options["quantize"] = config.quantize
    if config.chunk_steps is not None:
        options["chunk_steps"] = config.chunk_steps
    return EngineConfig(**options)


def build_systems(config: BenchConfig, weights: Weights) -> list[System]:
    """neuronpy first, then the selected peers in the order of PEERS."""
    from neuronpy.compose import engine_from_hf, start_tensor_parallel

    width = config.resolved_max_in_flight()
    queue = max(4096, config.requests, max(config.ks))
    http = config.drive == "http"

    def loader(settings: EngineConfig, split: bool = True) -> Callable[[], Engine]:
        """Builds the engine: split over --tensor-parallel ranks unless `split` is False."""
        if split and config.tensor_parallel > 1:
            return lambda: start_tensor_parallel(
                config.model,
                config.tensor_parallel,
                name=weights.name,
                config=settings,
                dtype=config.dtype,
                device=config.device,
            )
        return lambda: engine_from_hf(
            weights.hf_model, weights.tokenizer, name=weights.name, config=settings
        )

    def neuronpy(
        name: str,
        max_in_flight: int,
        url: str | None,
        *,
        spec: bool = False,
        compile: str = "auto",
        notes: tuple[str, ...] = (),
        workloads: frozenset[str] = frozenset(WORKLOADS),
    ) -> System:
        """neuronpy as `name`: at `url` over HTTP, else built here (served on loopback with
        --drive http)."""
        settings = engine_config(config, max_in_flight, queue, spec, compile)
        if http and url is not None:
            return NeuronpyHttp(name, url=url, model=weights.name, notes=notes, workloads=workloads)
        if http:
            return NeuronpyHttp(
                name,
                load_engine=loader(settings),
                model=weights.name,
                notes=(engine_label(settings), *notes),
                workloads=workloads,
            )
        return NeuronpyEngine(name, settings, loader(settings), notes=notes, workloads=workloads)

    # in-process and split over ranks: the same engine on one device beside it
    one_device_too = config.tensor_parallel > 1 and not http
    tp_note = (f"tensor parallel over {config.tensor_parallel} ranks",) if one_device_too else ()
    systems = [neuronpy(NEURONPY, width, config.url, notes=tp_note)]
    if config.speculative:
        if http and config.url is not None:
            raise ValueError("--speculative starts a server of its own: it cannot use --url")
        note = f"speculative {config.speculative}"
        systems.append(neuronpy(NEURONPY_SPEC, width, None, spec=True, notes=(note,)))
    if one_device_too:
        one = engine_config(config, width, queue)
        systems.append(NeuronpyEngine(NEURONPY_ONE_DEVICE, one, loader(one, split=False)))
    for peer in config.peers:
        if peer == NEURONPY_SERIAL:
            # over HTTP it gets a loopback server of its own, even when neuronpy is at --url
            systems.append(neuronpy(NEURONPY_SERIAL, 1, None, workloads=SERIAL_WORKLOADS))
        elif peer == NEURONPY_EAGER:
            systems.append(neuronpy(NEURONPY_EAGER, width, None, compile="off"))
        elif peer == HF_SERIAL:
            systems.append(
                HfGenerate(
                    HF_SERIAL, weights.hf_model, weights.tokenizer, static=False, batch_size=1
                )
            )
        elif peer == HF_STATIC:
            systems.append(
                HfGenerate(
                    HF_STATIC, weights.hf_model, weights.tokenizer, static=True, batch_size=width
                )
            )
        elif peer == HF_CB:
            systems.append(
                HfContinuousBatching(
                    HF_CB, weights.hf_model, max_batch_tokens=config.cb_max_batch_tokens
                )
            )
        else:
            raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    return systems


def vocabulary(weights: Weights) -> tuple[int, list[int]]:
    """The vocabulary prompts are drawn from: its size, and the special ids left out."""
    vocab = int(weights.hf_model.config.vocab_size)
    with_tokenizer = len(weights.tokenizer) if hasattr(weights.tokenizer, "__len__") else vocab
    return min(vocab, with_tokenizer), list(getattr(weights.tokenizer, "all_special_ids", []) or [])
