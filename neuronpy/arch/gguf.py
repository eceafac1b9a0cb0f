"""A GGUF file's tensors read as they are quantized, one tensor at a time, never through an
fp32 copy of the whole model.

What each GGML type becomes (the load log says it per type):
- Q4_0, Q4_1, Q4_K: 4-bit groups of 32 (GroupQuant), exactly: their blocks are 32 values with a
  scale and an offset (Q4_0: d * (q - 8); Q4_1: d * q + m; Q4_K: d * sc * q - dmin * m per
  32-value sub-block of a 256-value super-block), which is the int4 kernel's layout.
- Q5_0, Q5_1, Q5_K, Q8_0: 8-bit groups of 32, exactly, by the same rule (Q8_0: d * q as
  d * (q + 128) - 128 d; the 5-bit types as their 4-bit siblings); they run as two 4-bit planes.
- Q6_K: signed 6-bit levels with a scale per 16 values (SubBlockQuant), exactly; each
  16-value sub-block runs as a 32-column group of the int4 kernel.
- F32, F16, BF16: plain tensors.
Anything else is refused by name before a tensor is read.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuronpy.arch.quant import AnyWeight, GroupQuant, SubBlockQuant, dequantized
from neuronpy.errors import ModelLoadError

GROUP_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GROUP8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q8_0")
SUB_BLOCK_TYPES = ("Q6_K",)
PLAIN_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = GROUP_TYPES + GROUP8_TYPES + SUB_BLOCK_TYPES + PLAIN_TYPES
BECOMES = {
    **{t: "4-bit groups of 32 (exact)" for t in GROUP_TYPES},
    **{t: f"{t[1]}-bit groups of 32 (exact)" for t in GROUP8_TYPES},
    **{t: "6-bit sub-blocks of 16 (exact)" for t in SUB_BLOCK_TYPES},
    **{t: "plain" for t in PLAIN_TYPES},
}


def _fp16(column: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb] float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones (GGML's order)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def decode_groups(data: np.ndarray, kind: str, shape: tuple[int, int]) -> GroupQuant:
    """A Q4_0 / Q4_1 / Q4_K tensor's raw rows [N, bytes] as 4-bit groups of 32."""
    n, k = shape
    raw = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if kind == "Q4_K":
        blocks = raw.reshape(-1, 144)
        d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        from gguf.quants import Q4_K  # the 6-bit scale and minimum unpacking, as GGML writes it

        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # four chunks of 64 values, two sub-blocks each
        q = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 8, 32)
        scale = d[:, None] * sc.astype(np.float32)
        low = -(dmin[:, None] * m.astype(np.float32))
    else:
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        d = _fp16(blocks[:, 0:2])
        if kind == "Q4_0":
            scale, low, qs = d, -8 * d, blocks[:, 2:]
        else:
            scale, low, qs = d, _fp16(blocks[:, 2:4]), blocks[:, 4:]
        q = _nibbles(qs)
    return GroupQuant(
        q=torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, k // 32)),
        low=torch.from_numpy(np.ascontiguousarray(low, dtype=np.float32).reshape(n, k // 32)),
        group=32,
        kind=kind,
    )


# rows dequantized at a time for the 8-bit types: one tensor's fp32 copy never exists whole
DECODE_ROWS = 4096


def _block_scales(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Each 32-value group's (scale, low) of a 5- or 8-bit type's blocks: w = scale * q + low
    with q its unsigned level."""
    d = _fp16(blocks[:, 0:2])
    if kind == "Q8_0":
        return d, -128 * d
    if kind == "Q5_0":
        return d, -16 * d
    if kind == "Q5_1":
        return d, _fp16(blocks[:, 2:4])
    from gguf.quants import Q4_K  # Q5_K packs its sub-blocks' scales as Q4_K does

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), -(_fp16(blocks[:, 2:4])[:, None] * m)


def decode_groups8(tensor: TensorInfo) -> GroupQuant:
    """A Q5_0 / Q5_1 / Q5_K / Q8_0 tensor as 5- or 8-bit groups of 32: the scales from the blocks'
    headers, each level recovered from gguf's own dequantized value (w = scale * q + low, so
    (w - low) / scale rounds back to q exactly)."""
    from gguf.quants import dequantize

    n, k = tensor.shape
    size = {"Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176}[tensor.kind]  # bytes a block
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, size)
    scale, low = (
        np.asarray(a, dtype=np.float32).reshape(n, k // 32) for a in _block_scales(raw, tensor.kind)
    )
    q = np.empty((n, k), dtype=np.uint8)
    for lo in range(0, n, DECODE_ROWS):  # one tensor's fp32 copy never exists whole
        hi = min(lo + DECODE_ROWS, n)
        w = dequantize(tensor.data[lo:hi], tensor.qtype).reshape(hi - lo, k // 32, 32)
        s, m = scale[lo:hi, :, None], low[lo:hi, :, None]
        # (a scale may be negative: llama.cpp's Q5_0 signs it; zero in an all-zero group)
        level = np.where(s != 0, (w - m) / np.where(s != 0, s, 1), 0)
        q[lo:hi] = np.clip(np.rint(level), 0, 255).reshape(hi - lo, k)
    return GroupQuant(
        q=torch.from_numpy(q),
        scale=torch.from_numpy(scale),
        low=torch.from_numpy(low),
        group=32,
        kind=tensor.kind,
        bits=8 if tensor.kind == "Q8_0" else 5,
    )


def decode_sub_blocks(tensor: TensorInfo) -> SubBlockQuant:
    """A Q6_K tensor: each 16-value sub-block's scale d * sc from the block, each level
    recovered from gguf's own dequantized value (w = scale * u)."""
    from gguf.quants import dequantize

    n, k = tensor.shape
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 210)
    sc = np.ascontiguousarray(raw[:, 192:208]).view(np.int8).astype(np.float32)
    scale = (_fp16(raw[:, 208:210])[:, None] * sc).reshape(n, k // 16)
    u = np.empty((n, k), dtype=np.int8)
    for lo in range(0, n, DECODE_ROWS):  # one tensor's fp32 copy never exists whole
        hi = min(lo + DECODE_ROWS, n)
        w = dequantize(tensor.data[lo:hi], tensor.qtype).reshape(hi - lo, k // 16, 16)
        s = scale[lo:hi, :, None]
        level = np.where(s != 0, w / np.where(s != 0, s, 1), 0)
        u[lo:hi] = np.clip(np.rint(level), -32, 31).reshape(hi - lo, k)
    return SubBlockQuant(torch.from_numpy(u), torch.from_numpy(scale), tensor.kind)


def decode(tensor: TensorInfo) -> AnyWeight:
    """One tensor in the layout its type becomes (see the module docstring)."""
    kind, shape = tensor.kind, tensor.shape
    if len(shape) == 2:
        if kind in GROUP_TYPES:
            return decode_groups(tensor.data, kind, shape)  # type: ignore[arg-type]
        if kind in GROUP8_TYPES:
            return decode_groups8(tensor)
        if kind in SUB_BLOCK_TYPES:
            return decode_sub_blocks(tensor)
    from gguf.quants import dequantize

    values = dequantize(np.asarray(tensor.data), tensor.qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its raw bytes as rows (a view into the mapped file)."""

    name: str
    kind: str  # the GGML type's name: "Q4_1"
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first, as torch has it: a weight [N, K]
    data: np.ndarray  # uint8 [rows, bytes per row]


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array read_index did not decode (strings: the vocabulary, its merges): its
    length only."""

    count: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Past `count` strings, in one tight loop: read_index reads the default model's
        header (49k tokens, 49k merges) in ~20 ms, where a method call a string took ~70."""
        buf, pos, length = self.buf, self.pos, struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + length(buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> Any:
        """A scalar or string value; an array of numbers as a numpy view of the file; an
        array of strings or of arrays skipped, as a SkippedArray: the tokenizer's strings are
        transformers' to read, and decoding them here would cost a second."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                self.skip_strings(count)
            elif item == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY)
            else:
                fmt = _SCALARS[item]
                values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos)
                self.pos += count * struct.calcsize(fmt)
                return values
            return SkippedArray(count)
        return self.scalar(_SCALARS[vtype])


def read_index(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """A GGUF file's metadata and its tensors, the file mapped, not read: (fields, tensors).
    Fields hold scalars, strings, numpy arrays of numbers, and SkippedArray for an array of
    strings. Raises ModelLoadError for a file that is not GGUF (v2 or v3)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    try:
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{path.name} is not a GGUF file")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path.name} is GGUF version {version}; neuronpy reads 2 and 3")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(fields.get("general.alignment") or 32)
        start = -(-cur.pos // align) * align
        tensors = []
        for name, dims, type_id, offset in infos:
            qtype = GGMLQuantizationType(type_id)
            block, size = GGML_QUANT_SIZES[qtype]
            row = int(dims[0]) // block * size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            lo = start + offset
            data = mapped[lo : lo + rows * row].reshape(rows, row)
            shape = tuple(int(d) for d in reversed(dims))
            tensors.append(TensorInfo(name, qtype.name, qtype, shape, data))
    except (struct.error, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path.name} is not a readable GGUF file ({exc})") from None
    return fields, tensors


# GGUF's tensor names (llama.cpp's, one scheme for every Llama-family architecture) ->
# transformers'. GGUF's architectures whose q and k rows llama.cpp's converter permuted.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# LFM2 (llama.cpp's "lfm2"): its converter's names for transformers' Lfm2 modules. The final
# norm (transformers' embedding_norm, applied after the last layer) is token_embd_norm in
# llama.cpp's tensor map, output_norm in files of other converters (ollama's).
_LFM2_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "token_embd_norm": "model.embedding_norm",
    "output_norm": "model.embedding_norm",
    "output": "lm_head",
}
_LFM2_LAYER_NAMES = {
    "attn_norm": "operator_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
# Qwen3.5 (llama.cpp's "qwen35"): the Llama names, the norm after attention named
# post_attention_norm, and the Gated DeltaNet's (linear_attn) parts. Two of its tensors carry
# no .weight suffix in one scheme or the other: A_log is ssm_a, dt_bias ssm_dt.bias
# (_QWEN35_TENSORS).
_QWEN35_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
}
_QWEN35_TENSORS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# Qwen3-Next (llama.cpp's "qwen3next"): Qwen3.5's names, in_proj_qkvz split by the converter
# into attn_qkv (Qwen3.5's in_proj_qkv layout) and attn_gate (in_proj_z), in_proj_ba kept as
# transformers has it (ssm_ba); the mixture of experts' router, its shared expert and its gate,
# and its experts stacked [E, rows, columns], read expert by expert ("{}": the expert's index)
_QWEN3NEXT_LAYER_NAMES = {
    **{k: v for k, v in _QWEN35_LAYER_NAMES.items() if k not in ("ssm_beta", "ssm_alpha")},
    "ssm_ba": "linear_attn.in_proj_ba",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
# Granite 4 (llama.cpp's "granitehybrid", transformers' granitemoehybrid): the Llama names of
# attention and its norms, the Mamba2 layers' parts, the router; the experts' stacked
# input_linear split by the converter into gate (its first half) and up, stacked [E, rows,
# columns] and read expert by expert; the shared MLP's input_linear split alike into
# ffn_gate_shexp and ffn_up_shexp (ffn_gate and ffn_up in a model of no routed experts), all
# read as the shared MLP's gate_proj / up_proj / down_proj, which take_moe_block reads apart
_GRANITE_HYBRID_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q_norm", "attn_k_norm")},
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.experts.{}.gate_proj",
    "ffn_up_exps": "block_sparse_moe.experts.{}.up_proj",
    "ffn_down_exps": "block_sparse_moe.experts.{}.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.down_proj",
}
# (A_log, D and dt_bias carry no .weight: ssm_a, ssm_d, ssm_dt.bias)
_GRANITE_HYBRID_TENSORS = {
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_dt.bias": "mamba.dt_bias",
}
# GGUF architecture -> (its global names, its per-layer names, its per-layer whole names)
_NAMES = {
    "lfm2": (_LFM2_GLOBAL_NAMES, _LFM2_LAYER_NAMES, {}),
    "qwen35": (_GLOBAL_NAMES, _QWEN35_LAYER_NAMES, _QWEN35_TENSORS),
    "qwen3next": (_GLOBAL_NAMES, _QWEN3NEXT_LAYER_NAMES, _QWEN35_TENSORS),
    "granitehybrid": (_GLOBAL_NAMES, _GRANITE_HYBRID_LAYER_NAMES, _GRANITE_HYBRID_TENSORS),
}
NATIVE_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "lfm2",
    "qwen35",
    "qwen3next",
    "granitehybrid",
)
# the (1 + w) norms: llama.cpp's Qwen3-Next converter stores each as 1 + w, but the Gated
# DeltaNet's own (a plain w)
_OFFSET_NORM_ARCHITECTURES = ("qwen35", "qwen3next")
# (granitehybrid's converter is Llama's: it permutes q and k whether or not the model rotates
# them; Granite 4 attends without positions, but the rows are undone so that every product
# sums in transformers' order)
PERMUTED_ARCHITECTURES = ("llama", "mistral", "granitehybrid")


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The transformers parameter a GGUF tensor of architecture `arch` is (None: one the layers
    do not read, e.g. llama.cpp's precomputed RoPE factors). A stack of experts' weights is a
    pattern, "{}" standing for the expert's index."""
    global_names, layer_names, whole_names = _NAMES.get(arch, (_GLOBAL_NAMES, _LAYER_NAMES, {}))
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in whole_names:
        return f"model.layers.{parts[1]}.{whole_names[parts[2]]}"
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in global_names:
        return f"{global_names[stem]}.{suffix}"
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def _restore(arch: str, name: str, weight: AnyWeight) -> AnyWeight:
    """Tensor `name` (transformers') as transformers holds it, from the file's: undoes what
    llama.cpp's converter did to it beyond the name. LFM2: its convolution's [C, 1, K] weight
    squeezed to [C, K]. Qwen3.5: the same of its Gated DeltaNet's convolution; A_log stored as
    -exp(A_log), read back as log(-x) in float64 (GatedDeltaNet's -exp of it, rounded to float32,
    is the stored value exactly); each (1 + w) norm stored as 1 + w, read back as x - 1 (exact in
    float32 for x >= 0.5, so that the model's 1 + (x - 1) is x again). Granite 4
    (granitehybrid): its Mamba2 convolution squeezed as Qwen3.5's; A_log stored as -exp(A_log)
    [heads, 1], read back as Qwen3.5's; D stored [heads, 1]; the gated norm's weight stored
    [groups, inner / groups]: each flattened back."""
    if arch == "granitehybrid":
        return _restore_granite_hybrid(name, weight)
    if not isinstance(weight, torch.Tensor):
        return weight
    if arch == "lfm2" and name.endswith(".conv.conv.weight"):
        return weight.unsqueeze(1)
    if arch in _OFFSET_NORM_ARCHITECTURES:
        if name.endswith(".linear_attn.conv1d.weight") and weight.dim() == 2:
            return weight.unsqueeze(1)
        if name.endswith(".linear_attn.A_log"):
            return torch.log(-weight.double())
        if name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
            return weight.float() - 1
    return weight


def _restore_granite_hybrid(name: str, weight: AnyWeight) -> AnyWeight:
    """_restore's Granite 4 part (a quantized vector or norm, which llama-quantize leaves F32,
    is dequantized first)."""
    small = (".mamba.A_log", ".mamba.D", ".mamba.norm.weight", ".mamba.conv1d.weight")
    if not name.endswith(small):
        return weight
    if not isinstance(weight, torch.Tensor):
        weight = dequantized(weight, torch.float32)
    if name.endswith(".mamba.conv1d.weight"):
        return weight.unsqueeze(1) if weight.dim() == 2 else weight
    if name.endswith(".mamba.A_log"):
        return torch.log(-weight.double()).reshape(-1)
    return weight.reshape(-1)


def _layer(name: str) -> int:
    """The layer a transformers parameter belongs to (-1: none, a global tensor)."""
    parts = name.split(".", 3)
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return -1


def check_layout(path: Path, arch: str, config: Any) -> None:
    """Refuses a file whose tensors' layout neuronpy does not undo. Qwen3.5 with fewer key
    heads than value heads in its Gated DeltaNet: llama.cpp's converter reorders the value
    heads from grouped by key head to tiled (rows of in_proj_qkv's V, in_proj_z, in_proj_b/_a,
    A_log, dt_bias and the convolution's V channels, columns of out_proj), for ggml's
    broadcast; neuronpy computes them grouped, as transformers does."""
    if arch != "qwen35":  # (qwen3next's converter keeps transformers' grouped order)
        return
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nk != nv:
        raise ModelLoadError(
            f"{path.name}: a qwen35 GGUF file with {nk} key heads and {nv} value heads in its "
            "linear attention is not read as it is stored: llama.cpp's converter reordered "
            "its value heads (grouped by key head -> tiled), which neuronpy does not undo "
            "(transformers does not read qwen35 files either); serve the original checkpoint's "
            "directory instead"
        )


class GGUFCheckpoint:
    """The tensors of one GGUF file under transformers' parameter names, read on demand.

    `permute`: (query heads, KV heads) where the file holds q and k with llama.cpp's RoPE
    row order (its Llama converter's), which is undone here row by row. `arch`: the file's
    general.architecture, which names its tensors (hf_name) and says what the converter did
    to them (_restore). `config` and
    `generation_config` are transformers' for the file; `dtype` the model's."""

    def __init__(
        self,
        path: Path,
        *,
        config: Any,
        generation_config: Any,
        dtype: torch.dtype,
        fingerprint: str,
        permute: tuple[int, int] | None = None,
        arch: str = "llama",
    ) -> None:
        self.path = path
        self.config = config
        self.generation_config = generation_config
        self.dtype = dtype
        self.fingerprint = fingerprint
        self._permute = permute
        self.arch = arch
        check_layout(path, arch, config)
        _, tensors = read_index(path)
        layers = int(config.num_hidden_layers)
        self._tensors = {}
        for t in tensors:
            n = hf_name(t.name, arch)
            if n is None or _layer(n) >= layers:
                continue
            if "{}" in n:  # experts stacked [E, rows, columns]: each its own [rows, columns]
                rows = t.shape[1]
                for e in range(t.shape[0]):
                    data = t.data[e * rows : (e + 1) * rows]
                    self._tensors[n.format(e)] = TensorInfo(
                        t.name, t.kind, t.qtype, t.shape[1:], data
                    )
            else:
                self._tensors[n] = t
        unknown = sorted({t.kind for t in self._tensors.values()} - set(SUPPORTED_TYPES))
        if unknown:
            raise ModelLoadError(
                f"{path.name} holds tensors of GGML type {', '.join(unknown)}, which neuronpy "
                f"does not read; it reads {', '.join(SUPPORTED_TYPES)}"
            )

    def types(self) -> Counter[str]:
        """How many tensors of each GGML type the model reads."""
        return Counter(t.kind for t in self._tensors.values())

    def describe(self) -> str:
        """One line for the load log: each type, its count, and what it became."""
        return "; ".join(
            f"{count} {kind} -> {BECOMES[kind]}" for kind, count in sorted(self.types().items())
        )

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> AnyWeight | None:
        """Tensor `name` decoded (None when the file has none), q and k rows in transformers'
        order. Each call decodes anew: whoever asks keeps it."""
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        weight = decode(tensor)
        if self._permute is not None and (".q_proj." in name or ".k_proj." in name):
            heads = self._permute[0] if ".q_proj." in name else self._permute[1]
            weight = _take_rows(weight, _rope_rows(weight.shape[0], heads))
        return _restore(self.arch, name, weight)


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: its converter interleaves each
    head's two rotary halves; transformers keeps them as halves."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _take_rows(weight: AnyWeight, index: torch.Tensor) -> AnyWeight:
    if isinstance(weight, torch.Tensor):
        return weight[index]
    return weight.take_rows(index)
