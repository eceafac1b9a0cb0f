"""The composition root: builds a model's engine, on one device or over tensor-parallel ranks."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from neuronpy.arch.gguf import GGUFCheckpoint, read_index
from neuronpy.arch.llama import LlamaModel, measure_input_ranges
from neuronpy.arch.stored import StoredCheckpoint
from neuronpy.arch.vision import VisionTower
from neuronpy.config import EngineConfig, ModelSpec
from neuronpy.defaults import WEIGHT_ONLY_MODES
from neuronpy.engine.embeddings import Pooling
from neuronpy.engine.engine import Engine
from neuronpy.loading import (
    calibration_ids,
    eos_token_ids,
    gguf_spec,
    load_gguf_checkpoint,
    load_pretrained,
    load_processor,
    load_stored_checkpoint,
    packed_experts,
    resolve_device,
    sentence_transformers_pooling,
)
from neuronpy.worker.session_files import model_fingerprint
from neuronpy.worker.tp import DEFAULT_TIMEOUT, ShardSpec
from neuronpy.worker.tp_start import DEFAULT_STARTUP_TIMEOUT, start_tensor_parallel_worker
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger("neuronpy")

# the modes a GGUF file is read in as it is stored (else transformers dequantizes it)
NATIVE_GGUF_MODES = ("auto", "int8", *WEIGHT_ONLY_MODES)


def native_model(source: Any, tokenizer: Any, *, name: str, config: EngineConfig) -> LlamaModel:
    """neuronpy's model of `source` (as engine_from_hf takes it), its weights in
    `config.quantize` (the int8 mode calibrated on the built-in text), its layers compiled as
    `config.compile` says."""
    calibration = calibration_ids(source, tokenizer, config.quantize)
    ranges = None
    if calibration and isinstance(source, GGUFCheckpoint):
        # a file read as it is stored: the int8 mode's activation ranges measured on the
        # model as the file holds it (no float copy of it is ever made), then that one freed
        stored = LlamaModel.from_hf(source, quantize="auto")
        ranges = measure_input_ranges(stored, calibration)
        del stored
        release_freed_memory()
    model = LlamaModel.from_hf(
        source, quantize=config.quantize, calibration_ids=calibration, input_ranges=ranges
    )
    release_freed_memory()
    log.info(
        "%s: %s of weights in memory (%s)",
        name,
        _mib(model.weight_bytes()),
        model.describe_weights(),
    )
    compile_model(model, name, config.compile)
    return model


def engine_from_hf(
    source: Any,
    tokenizer: Any,
    *,
    name: str,
    config: EngineConfig | None = None,
    draft: tuple[Any, Any] | None = None,
) -> Engine:
    """An engine over a loaded transformers model, or a checkpoint read as it is stored (a
    GGUF file's: loading.load_gguf_checkpoint): its native model (quantized as `config`
    says), EOS ids from both sources, and the checkpoint's fingerprint for saved sessions.
    `draft`: a draft model for speculative decoding and its tokenizer (transformers'), which
    must be the model's own."""
    config = config or EngineConfig()
    model = native_model(source, tokenizer, name=name, config=config)
    draft_model = None
    if draft is not None:
        draft_model = native_draft(draft, tokenizer, name=name, config=config)
    return engine_over(model, source, tokenizer, name=name, config=config, draft=draft_model)


def native_draft(
    draft: tuple[Any, Any], tokenizer: Any, *, name: str, config: EngineConfig
) -> LlamaModel:
    """neuronpy's model of a draft model (a transformers model and its tokenizer, which must
    be `tokenizer`), its weights in `config.quantize`, its layers compiled as `config.compile`
    says."""
    check_draft_tokenizer(tokenizer, draft[1])
    model = LlamaModel.from_hf(draft[0], quantize=config.quantize)
    compile_model(model, f"{name} (its draft model)", config.compile)
    return model


def engine_over(
    model: LlamaModel,
    source: Any,
    tokenizer: Any,
    *,
    name: str,
    config: EngineConfig,
    draft: LlamaModel | None = None,
) -> Engine:
    """The engine over `model`, built from `source` as native_model builds it (and `draft`,
    as native_draft does): the pooling, EOS ids and fingerprint of `source`."""
    task, pooling = resolve_pooling(source, config)
    if task == "embed" or pooling.source != "default":
        log.info(
            "%s: task %s; embeddings pool by %s%s (%s)",
            name,
            task,
            pooling.mode,
            ", normalized" if pooling.normalize else "",
            pooling.source,
        )
    processor = load_processor(source)
    vision = None
    if processor is not None:
        vision = VisionTower(source)
        model.bidirectional_images = vision.bidirectional
        log.info("%s: reads images (%s vision tower)", name, _mib(vision.nbytes))
    return Engine(
        model,
        tokenizer,
        name=name,
        config=config,
        eos_token_ids=eos_token_ids(source, tokenizer),
        fingerprint=_fingerprint(source, config.quantize),
        worker=DeviceWorker(model, name, config.prefill_chunk, draft, vision),
        task=task,
        pooling=pooling,
        source=source_facts(source),
        processor=processor,
    )


def resolve_pooling(source: Any, config: EngineConfig) -> tuple[str, Pooling]:
    """The task a model serves and how its embeddings pool: the config's where it says, else
    the checkpoint's sentence-transformers config (which makes "auto" an embedding model),
    else generation, pooling the last token's hidden state, normalized."""
    declared = None if isinstance(source, GGUFCheckpoint) else sentence_transformers_pooling(source)
    task = config.task
    if task == "auto":
        task = "embed" if declared is not None else "generate"
    mode, normalize, where = "last", True, "default"
    if declared is not None:
        (mode, normalize), where = declared, "sentence-transformers config"
    if config.pooling != "auto":
        mode, where = config.pooling, "config"
    if config.normalize is not None:
        normalize, where = config.normalize, "config"
    return task, Pooling(mode, normalize, where)


def release_freed_memory() -> None:
    """Hands the memory freed while weights were converted back to the system (glibc keeps
    freed heap pages otherwise: ~300 MB of RSS for the default model's conversions)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _fingerprint(source: Any, quantize: str) -> str:
    """A checkpoint read as stored: its files' key; else a hash of a transformers model's
    weights."""
    if isinstance(source, GGUFCheckpoint | StoredCheckpoint):
        return model_fingerprint({}, extra=(source.fingerprint, quantize))
    return model_fingerprint(source.state_dict(), extra=(quantize,))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """What compiling a model's layers did: graphs PyTorch's caches gave whole (its traced
    graph and inductor's code), and graphs traced through AOTAutograd and compiled here (a
    cache miss: a first start, another PyTorch, other flags)."""

    from_cache: int
    compiled: int


# one model's compile at a time, so that PyTorch's process-wide counters, read before and
# after, count its graphs alone (dynamo compiles one frame at a time anyway: no time lost)
_COMPILING = threading.Lock()
_CACHE_COUNTERS = {  # (PyTorch's counter group, counter): whether it counts a graph compiled
    ("aot_autograd", "autograd_cache_hit"): False,
    ("aot_autograd", "autograd_cache_miss"): True,
    ("aot_autograd", "autograd_cache_bypass"): True,
    ("inductor", "fxgraph_cache_hit"): False,
    ("inductor", "fxgraph_cache_miss"): True,
    ("inductor", "fxgraph_cache_bypass"): True,
}


def _cache_counters() -> dict[tuple[str, str], int]:
    # (dynamo's counters, imported here: a model served eagerly never loads the compiler)
    from torch._dynamo.utils import counters

    return {(group, name): counters[group][name] for group, name in _CACHE_COUNTERS}


def _counts_since(before: dict[tuple[str, str], int]) -> CompileCounts:
    """The graphs from the cache and compiled since `before`: by AOTAutograd's cache (a hit
    there is the graph whole, traced and compiled), else by inductor's FX graph cache (where
    AOTAutograd's is off)."""
    now = _cache_counters()
    for group in ("aot_autograd", "inductor"):
        seen = {key: now[key] - before[key] for key in _CACHE_COUNTERS if key[0] == group}
        if any(seen.values()):
            hits = sum(n for key, n in seen.items() if not _CACHE_COUNTERS[key])
            return CompileCounts(from_cache=hits, compiled=sum(seen.values()) - hits)
    return CompileCounts(from_cache=0, compiled=0)


def compile_model(model: LlamaModel, name: str, mode: str) -> CompileCounts | None:
    """Compiles the model's layers as `mode` says ("auto": on the CPU; see EngineConfig), and
    says how many graphs came from PyTorch's cache; None where they were not compiled. A model
    the compiler cannot take runs eagerly, and the log says why."""
    if mode == "off" or (mode == "auto" and model.device.type != "cpu"):
        return None
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "PyTorch's default")
    log.info(
        "%s: compiling its layers (PyTorch's inductor, its cache in %s; the default model on "
        "2 cores: 1-2 minutes the first time, 12-15 s from the cache after)",
        name,
        cache,
    )
    with _COMPILING:
        started = time.perf_counter()
        before = _cache_counters()
        try:
            model.compile()
        except Exception as exc:  # the compiler's errors are many types; the model still serves
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning(
                "%s: could not compile its layers (%s: %s); they run eagerly",
                name,
                type(exc).__name__,
                reason,
            )
            return None
        counts = _counts_since(before)
    log.info(
        "%s: compiled its layers in %.1f s (%s from the cache, %d compiled)",
        name,
        time.perf_counter() - started,
        _graphs(counts.from_cache),
        counts.compiled,
    )
    return counts


def _graphs(n: int) -> str:
    return f"{n} graph" if n == 1 else f"{n} graphs"


def check_draft_tokenizer(tokenizer: Any, draft_tokenizer: Any) -> None:
    """ValueError unless the draft model writes the model's tokens: the same vocabulary."""
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "the draft model's tokenizer is not the model's: speculative decoding needs a "
            "draft model of the same vocabulary"
        )


def source_facts(source: Any) -> tuple[int, str]:
    """(parameter count, how the weights are stored) of a checkpoint: a GGUF file's from its
    header (its general.file_type, as llama.cpp names it: "Q4_K_M"), a transformers model's
    from its parameters and their dtype ("BF16"); (0, "") where neither is known."""
    if isinstance(source, GGUFCheckpoint):
        return gguf_file_facts(source.path)
    if isinstance(source, StoredCheckpoint):
        return source.facts()
    try:
        params = list(source.parameters())
    except (AttributeError, TypeError):
        return 0, ""
    if not params:
        return 0, ""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    return sum(p.numel() for p in params), names.get(params[0].dtype, str(params[0].dtype))


def gguf_file_facts(path: Any) -> tuple[int, str]:
    """A GGUF file's parameter count and file type, from its header alone."""
    from gguf import LlamaFileType

    fields, tensors = read_index(path)
    count = sum(math.prod(t.shape) for t in tensors)
    kind = fields.get("general.file_type")
    try:
        name = LlamaFileType(int(kind)).name.removeprefix("MOSTLY_") if kind is not None else ""
    except ValueError:
        name = ""
    if not name and tensors:  # the type most of the weights are stored in
        kinds = [t.kind for t in tensors if len(t.shape) == 2]
        name = max(set(kinds), key=kinds.count) if kinds else ""
    return count, name


def load_source(spec: ModelSpec, progress: Callable[[str], None]) -> tuple[Any, Any]:
    """What `spec`'s weights load as, for native_model and engine_from_hf: a GGUF file's
    checkpoint read as it is stored where the mode keeps it so (on the CPU), else a loaded
    transformers model; and the tokenizer."""
    quantize = spec.engine.quantize
    device = resolve_device(spec.device)
    if quantize in WEIGHT_ONLY_MODES and torch.device(device).type != "cpu":
        raise ValueError(
            f"--quantize {quantize} runs on the CPU (PyTorch's weight-only kernels); on "
            f"{device} use --quantize none"
        )
    if gguf_spec(spec.path) is not None and device == "cpu" and quantize in NATIVE_GGUF_MODES:
        source, tokenizer, _ = load_gguf_checkpoint(spec.path, dtype=spec.dtype, log=progress)
        return source, tokenizer
    if packed_experts(spec.path) and device == "cpu":
        # (gpt-oss: its MXFP4 experts dequantized one at a time as their layers are built,
        # not the whole model in float through transformers first)
        stored, tokenizer, _ = load_stored_checkpoint(spec.path, dtype=spec.dtype, log=progress)
        return stored, tokenizer
    # weights quantized at load compute between the layers in fp32 (see resolve_dtype): their
    # kernels take their own input types whatever the model's, and fp32 is the exact mode
    fp32 = quantize in (*WEIGHT_ONLY_MODES, "int8")
    dtype = "float32" if spec.dtype == "auto" and fp32 else spec.dtype
    weights = load_pretrained(spec.path, dtype=dtype, device=device, log=progress)
    return weights.hf_model, weights.tokenizer


def load_engine(name: str, spec: ModelSpec) -> Engine:
    """Load one model's weights and build its engine (blocking: the server calls it in a thread
    of its own for each model, so the models load concurrently)."""

    def progress(message: str) -> None:
        log.info("%s: %s", name, message)

    if spec.tensor_parallel > 1 and spec.engine.draft_model:
        raise ValueError("a draft model cannot draft for a tensor-parallel model (yet)")
    if spec.tensor_parallel > 1:
        world = os.environ.get("WORLD_SIZE")
        if world is not None and world != str(spec.tensor_parallel):
            raise ValueError(
                f"WORLD_SIZE={world} in the environment, but --tensor-parallel is "
                f"{spec.tensor_parallel}: they must agree"
            )
        return start_tensor_parallel(
            spec.path,
            spec.tensor_parallel,
            name=name,
            config=spec.engine,
            dtype=spec.dtype,
            device=spec.device,
            # followers on other machines when the environment describes the group
            spawn="WORLD_SIZE" not in os.environ,
            log_fn=progress,
        )
    source, tokenizer = load_source(spec, progress)
    draft = None
    if spec.engine.draft_model:
        loaded = load_pretrained(
            spec.engine.draft_model, dtype=spec.dtype, device=spec.device, log=progress
        )
        draft = (loaded.hf_model, loaded.tokenizer)
    return engine_from_hf(source, tokenizer, name=name, config=spec.engine, draft=draft)


def start_tensor_parallel(
    model: str | None,
    world_size: int,
    *,
    name: str | None = None,
    config: EngineConfig | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    spawn: bool = True,
    master_addr: str | None = None,
    master_port: int | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    threads: int | None = None,
    log_fn: Callable[[str], None] = log.info,
) -> Engine:
    """An Engine over `world_size` tensor-parallel ranks of `model` (a load_pretrained spec;
    None: the default model), rank 0 in this process. `spawn`: start the other ranks here
    (one machine); else wait for them to call `run_follower` (see neuronpy.worker.tp_start).
    `config.quantize` and `config.prefill_chunk` apply to every rank. `threads`: torch threads
    of each spawned follower. Blocking: call it from a thread, as the server loads models."""
    config = config or EngineConfig()
    spec = ShardSpec(
        model=model,
        world_size=world_size,
        dtype=dtype,
        device=device,
        quantize=config.quantize,
        prefill_chunk=config.prefill_chunk,
        timeout=timeout,
        threads=threads,
    )
    worker, weights = start_tensor_parallel_worker(
        spec,
        name=name or "model",
        spawn=spawn,
        master_addr=master_addr,
        master_port=master_port,
        startup_timeout=startup_timeout,
        log_fn=log_fn,
    )
    return Engine(
        worker.model,
        weights.tokenizer,
        name=name or weights.name,
        config=config,
        eos_token_ids=eos_token_ids(weights.hf_model, weights.tokenizer),
        worker=worker,
    )
