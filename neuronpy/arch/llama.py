"""The decoder in plain PyTorch: chunked prefill into a snapshot, and the lockstep (B, 1)
decode step over a live batch. One forward for every family; what a family changes in it
(norms, activation, RoPE per layer, sliding windows, scales and soft-caps) is its ArchConfig's
(arch/config.py)."""

from __future__ import annotations

import functools
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from neuronpy.arch import ops
from neuronpy.arch.attention import (
    Attention,
    AttentionForm,
    GroupStep,
    NoAttention,
    PackedAttention,
    PrefillChunk,
    RaggedStep,
    SequenceAttention,
    StepAttention,
    StepOutput,
    UniformStep,
    snapshot_of,
    window_decode_mask,
)
from neuronpy.arch.config import ArchConfig
from neuronpy.arch.exact import chunk_attention, grouped_sinks, soft_cap, step_attention
from neuronpy.arch.kv import KvBatch, KvGroup, KvSnapshot, States
from neuronpy.arch.linear import Linear
from neuronpy.arch.mixer import Mixer
from neuronpy.arch.moe import MoeBlock
from neuronpy.arch.quant import QuantEmbedding
from neuronpy.arch.rope import apply_rope, rope_cos_sin
from neuronpy.arch.weights import (
    AnyLinear,
    LayerWeights,
    MlaWeights,
    ModelWeights,
    take_weights,
)
from neuronpy.defaults import DEFAULT_PREFILL_CHUNK
from neuronpy.envflags import env_flag
from neuronpy.media import past_image, split_media_id

# rows of a forward whose input is given rather than looked up: (row indexes [K], inputs
# [K, hidden]) (see `LlamaModel._run`)
Inserts = tuple[torch.Tensor, torch.Tensor]
# projections per layer in the compiled graph's numbering (see LlamaModel._linear)
SLOTS = 5
# leading logits of a row a quantized tied head recomputes in fp32 (see LlamaModel._refine)
REFINED_LOGITS = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as the reference does. A float32 weight
    over a lower-precision x multiplies before rounding (Gemma's `(x * w).to(dtype)`), one in
    x's dtype after (Llama's `w * x.to(dtype)`)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one fused operation rather than seven (bitwise the same result in float32)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """A Llama-family decoder as pure tensors. Built from a transformers model's weights."""

    def __init__(
        self,
        config: ArchConfig,
        embed: torch.Tensor | QuantEmbedding,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: AnyLinear,
        inv_freq: torch.Tensor,
        rope_scale: float,
        ropes: Sequence[tuple[torch.Tensor, float]] = (),
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self.lm_head = lm_head  # hidden -> vocab
        self.inv_freq = inv_freq.to(embed.device)  # [rotary_dim/2] float32
        self.rope_scale = rope_scale
        # every RoPE the layers use (config.rope_of(layer) picks one); the first is inv_freq's
        self.ropes = [(self.inv_freq, rope_scale)] + [
            (f.to(embed.device), scale) for f, scale in list(ropes)[1:]
        ]
        # Gemma scales embeddings by sqrt(hidden) rounded to its dtype; Granite by a float
        self._embed_scale: float | torch.Tensor = config.embed_scale
        if config.embed_scale_rounded:
            self._embed_scale = torch.tensor(
                config.embed_scale, dtype=self.dtype, device=self.device
            )
        # Tensor parallelism (arch/tp.py): o_proj and down hold a slice of their inputs, so each
        # rank's output is a partial sum that this all-reduce completes before the residual.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # a prompt's image tokens see their whole image at prefill (Gemma 3's vision-language
        # model; set where its vision tower is: compose.py), else causally as any token
        self.bidirectional_images = False
        self._attention: Attention | None = None  # the running forward's (see _run)
        self._handle: torch.Tensor | None = None  # what the compiled graph names it by
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # each layer's place among the attention layers (their KV in a snapshot's keys and
        # values) and among the fixed-size-state ones (their states); -1 where it is not one
        self.kv_index: list[int] = []
        self.state_index: list[int] = []
        kv = state = 0
        for lw in layers:
            self.kv_index.append(-1 if lw.mixer is not None else kv)
            self.state_index.append(state if lw.mixer is not None else -1)
            kv, state = kv + (lw.mixer is None), state + (lw.mixer is not None)
        self.num_kv_layers, self.num_state_layers = kv, state

    @property
    def has_states(self) -> bool:
        """Whether some layer keeps a fixed-size state (arch/mixer.py) besides the KV."""
        return self.num_state_layers > 0

    def mixer(self, layer: int) -> Mixer:
        """Layer `layer`'s fixed-size-state mixer."""
        mixer = self.layers[layer].mixer
        assert mixer is not None, f"layer {layer} is an attention layer"
        return mixer

    def zero_states(self, layer: int, rows: int = 1) -> States:
        """A state before any token of mixer layer `layer`, for `rows` rows."""
        return tuple(
            torch.zeros(rows, *spec.shape, dtype=spec.dtype, device=self.device)
            for spec in self.mixer(layer).state_specs()
        )

    def state_layout(self) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
        """Per fixed-size-state layer, its state tensors' shapes (a row's) and dtypes."""
        return [
            [(spec.shape, spec.dtype) for spec in lw.mixer.state_specs()]
            for lw in self.layers
            if lw.mixer is not None
        ]

    def state_bytes(self) -> int:
        """The bytes of one sequence's fixed-size states, all layers (0: attention only)."""
        return sum(
            torch.Size(shape).numel() * dtype.itemsize
            for layer in self.state_layout()
            for shape, dtype in layer
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            x = F.embedding(ids, self.embed)
        else:
            x = self.embed(ids)  # kept quantized (arch/quant.py)
        if self.config.embed_scale_rounded:
            return x * self._embed_scale
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale

    def identity(self) -> dict[str, torch.Tensor]:
        """Tensors that tell this model's weights from another's (saved sessions' fingerprint):
        the embedding table (its stored values when quantized), every norm and every layer's
        attention sinks (gpt-oss)."""
        embed = self.embed if isinstance(self.embed, torch.Tensor) else self.embed.values
        norms = {
            f"{i}.{name}": t
            for i, lw in enumerate(self.layers)
            for name in ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "sinks")
            if (t := getattr(lw, name)) is not None
        }
        return {"embed": embed, "norm": self.norm, **norms}

    def _linears(self) -> list[Any]:
        dense = [(lw.qkv, lw.o_proj, lw.gate_up, lw.down) for lw in self.layers]
        experts = [lw.moe.linears() for lw in self.layers if lw.moe is not None]
        mixers = [lw.mixer.linears() for lw in self.layers if lw.mixer is not None]
        return [lin for lins in dense + experts + mixers for lin in lins if lin is not None]

    def weight_bytes(self) -> int:
        """The bytes its weights take (the embedding, projections, norms)."""
        head = getattr(self.lm_head, "nbytes", 0)
        if getattr(self.embed, "values", None) is getattr(self.lm_head, "_q", False):
            head = 0  # a tied head computing with the embedding's own int8 values
        # (identity() holds the embedding's table, every norm and the sinks)
        tables = sum(t.nbytes for name, t in self.identity().items() if name != "embed")
        return self.embed.nbytes + sum(lin.nbytes for lin in self._linears()) + head + tables

    def describe_weights(self) -> str:
        """What its weights are, for the load log: each projection kind and its count."""
        kinds = Counter(lin.kind for lin in self._linears())
        embed = self.embed.kind if isinstance(self.embed, QuantEmbedding) else str(self.dtype)
        head = getattr(self.lm_head, "kind", "none")
        layers = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        return f"projections: {layers}; LM head: {head}; embedding: {embed.removeprefix('torch.')}"

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_weights(cls, weights: ModelWeights) -> LlamaModel:
        return cls(
            config=weights.config,
            embed=weights.embed,
            layers=weights.layers,
            norm=weights.norm,
            lm_head=weights.lm_head,
            inv_freq=weights.inv_freq,
            rope_scale=weights.rope_scale,
            ropes=weights.ropes,
        )

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        quantize: str = "none",
        calibration_ids: Sequence[int] = (),
        input_ranges: Mapping[str, torch.Tensor] | None = None,
    ) -> LlamaModel:
        """Takes the weights of a loaded transformers `*ForCausalLM` (or a checkpoint read as
        it is stored). `quantize="int8"` turns every projection (the vocabulary one included)
        into an int8 one (arch/int8.py's Int8Linear), smoothed with activation ranges measured on
        `calibration_ids` (a transformers model) or given (`input_ranges`, as
        measure_input_ranges measures them)."""
        weights = take_weights(
            hf_model,
            quantize=quantize,
            calibration_ids=calibration_ids,
            input_ranges=input_ranges,
        )
        return cls.from_weights(weights)

    # ---- the layers: one loop for every forward (prefill chunks, decode and verify steps) ---

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        inserts: Inserts | None = None,
    ) -> torch.Tensor:
        """Every token through every layer: ids, positions [N] -> final-normed hidden
        [N, hidden]. Each linear layer runs once over all N tokens (a decode step's rows and
        the tokens of the prompt chunks prefilled with it, together); `attention` says what
        each token attends to, and where its K/V go. `inserts`: rows whose input is given
        (an image's, from the vision tower) in place of their token's embedding. Compiled
        (see `compile`) or eager: the same code, the same math."""
        x = self._embed(ids)  # [N, hidden] (outside the graph: inserts replace its rows)
        if inserts is not None:
            x[inserts[0]] = inserts[1]
        self._attention = attention
        try:
            if self._compiled is None:
                return self._layers(x, positions)
            n = ids.shape[0]
            if n == 1:  # the graph takes two tokens or more: a lone token runs with a copy
                x, positions = x.repeat(2, 1), positions.repeat(2)
            # (the graph's guards tell inference tensors from others: one kind, one graph)
            x, positions = (t if t.is_inference() else t.clone() for t in (x, positions))
            return self._compiled(x, positions)[:n]
        finally:
            self._attention = None

    @property
    def compiled(self) -> bool:
        """Whether forwards run the compiled graph (see `compile`)."""
        return self._compiled is not None

    def compile(self) -> None:
        """Compiles the layers with PyTorch's compiler (inductor) for every later forward, now.

        One graph for any number of tokens (a dynamic dimension; a lone token runs as two,
        itself and a copy), so it serves prefill chunks and decode and verify steps, with or
        without prompt chunks in the same forward, alike. Linear layers and attention stay
        the model's own (arch/ops.py): the graph fuses what lies between them (norms, RoPE,
        residuals, the MLP's activation), which eager PyTorch runs as dozens of small
        operations per layer. Raises what the compiler raised when it cannot compile this
        model; the model then stays eager."""
        if self.reduce is not None:
            raise NotImplementedError("a tensor-parallel shard runs eagerly")
        self._handle = ops.register(self)
        # Dynamo keeps its graphs per code object, in a cache of 8, and every model's guards
        # differ (its own weights and config): models sharing `_layers`'s code would share one
        # cache, and a ninth compiled model would fail under fullgraph. Each model compiles a
        # copy of the code, with a cache of its own (the graph it traces is the same)
        code = LlamaModel._layers.__code__.replace()
        layers = types.MethodType(types.FunctionType(code, LlamaModel._layers.__globals__), self)
        # rounding where eager rounds (bf16, fp16): compiled or not, the same answers. (Not
        # inductor's cpp_wrapper: 2% faster alone, but it hands the GIL back and forth so
        # often that a busy event loop beside it makes a step ~20x slower)
        options = {"emulate_precision_casts": True}
        compiled = torch.compile(layers, dynamic=True, fullgraph=True, options=options)
        self._attention = NoAttention(2)
        try:
            # The config's floats (norm eps, RoPE and embedding scales) as constants: under
            # dynamic=True dynamo would make each a symbolic input, and one the graph must fix
            # (a branch on it, an op that takes a number) restarts the whole trace after
            # AOTAutograd has traced it, so every start, warm ones too, would trace the layers
            # twice and miss AOTAutograd's cache once (the first attempt's key gets no entry)
            with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode():
                x = self._embed(torch.zeros(2, dtype=torch.long, device=self.device))
                compiled(x, torch.arange(2, device=self.device))  # traced and compiled here
        finally:
            self._attention = None
        self._compiled = compiled

    def linear_at(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index` (SLOTS per layer: qkv, o_proj, gate_up, down, an MLA query's
        second step) over x (arch/ops)."""
        return self._projections[index](x)

    @functools.cached_property
    def _projections(self) -> list[AnyLinear]:
        return [
            p
            for lw in self.layers
            for p in (lw.qkv, lw.o_proj, lw.gate_up, lw.down, lw.mla and lw.mla.q_b)
        ]

    def mix_at(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The running forward's fixed-size-state layer `layer` over x (arch/ops), as
        `attend_at`."""
        attention = self._running()
        return _pad_rows(attention.mix(self, layer, x[: attention.tokens]), x.shape[0])

    def moe_at(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s mixture-of-experts block over x (arch/ops)."""
        block = self.layers[layer].moe
        assert block is not None
        return block(x)

    def attend_at(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The running forward's attention in `layer`, for the compiled graph (arch/ops): its
        tokens, and zeros for the copy a lone token runs with (see `_run`)."""
        attention = self._running()
        n = attention.tokens
        return _pad_rows(attention.attend(self, layer, q[:n], k[:n], v[:n]), q.shape[0])

    def _running(self) -> Attention:
        assert self._attention is not None, "no forward is running"
        return self._attention

    def _layers(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        # cos/sin [N, rotary_dim] of each RoPE the layers use, once per forward
        tables = [rope_cos_sin(f, scale, positions, self.dtype) for f, scale in self.ropes]
        for layer, lw in enumerate(self.layers):
            if lw.mixer is not None:  # a fixed-size-state layer: its own projections
                out = self._mix(layer, rms_norm(x, lw.input_norm, c.rms_norm_eps))
            else:
                rope = c.rope_of(layer)
                cos_sin = None if rope is None else tables[rope]
                if lw.mla is not None:  # latent attention: its own query, key and output
                    assert cos_sin is not None
                    q, k, v = self._mla_qkv(layer, lw, x, cos_sin)
                    attn = self._mla_output(lw.mla, self._attend(layer, q, k, v))
                else:
                    # q [N, H, D]; k, v [N, KVH, D]
                    q, k, v, gate = self._qkv(layer, lw, x, cos_sin)
                    attn = self._attend(layer, q, k, v)
                    if gate is not None:  # Qwen3-Next's output gate, per head and dim
                        attn = attn * torch.sigmoid(gate)
                out = self._linear(layer, 1, lw.o_proj, attn)
            x = self._finish_layer(layer, lw, x, out)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def _mix(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """This forward's fixed-size-state layer `layer`: [N, hidden] (an opaque operator in a
        compiled graph: its states live outside it, as the KV does)."""
        if torch.compiler.is_compiling():
            assert self._handle is not None
            return ops.mix(x, self._handle, layer)
        assert self._attention is not None
        return self._attention.mix(self, layer, x)

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """This forward's attention in one layer: [N, H * D]."""
        if torch.compiler.is_compiling():
            assert self._handle is not None
            width = self.config.num_heads * self.config.value_dim
            return ops.attend(q, k, v, self._handle, layer, width)
        assert self._attention is not None
        return self._attention.attend(self, layer, q, k, v)

    def _linear(self, layer: int, slot: int, lin: AnyLinear, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s projection `slot` (0 qkv, 1 o_proj, 2 gate_up, 3 down, 4 an MLA
        query's second step) over x."""
        if torch.compiler.is_compiling():
            assert self._handle is not None
            return ops.linear(x, self._handle, SLOTS * layer + slot, lin.out_features)
        return lin(x)

    def _moe(self, layer: int, block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s mixture-of-experts block over x (arch/moe.py): an opaque operator
        in a compiled graph, as its shapes depend on the routing."""
        if torch.compiler.is_compiling():
            assert self._handle is not None
            return ops.moe(x, self._handle, layer)
        return block(x)

    def _qkv(
        self,
        layer: int,
        lw: LayerWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [N, hidden] -> q [N, H, D], k and v [N, KVH, D] (q and k after RoPE, when the
        layer has one: `cos_sin`), and the output gate [N, H * D] where the family has one
        (Qwen3-Next: each head's query rows followed by its gate rows)."""
        c = self.config
        n, d = x.shape[0], c.head_dim
        qkv = self._linear(layer, 0, lw.qkv, rms_norm(x, lw.input_norm, c.rms_norm_eps))
        gate = None
        if c.attn_gate:
            qg, kv = qkv.split([2 * c.num_heads * d, 2 * c.num_kv_heads * d], dim=-1)
            q, g = qg.view(n, c.num_heads, 2 * d).split([d, d], dim=-1)
            gate = g.reshape(n, c.num_heads * d)
            qkv = torch.cat((q.reshape(n, c.num_heads * d), kv), dim=-1)
        if cos_sin is not None and lw.q_norm is None and lw.k_norm is None:
            # RoPE over the query and key heads at once: half the operations (same values)
            cos, sin = cos_sin
            heads = c.num_heads + c.num_kv_heads
            qk, v = qkv.split([heads * d, c.num_kv_heads * d], dim=-1)
            qk = apply_rope(qk.view(n, heads, d), cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            return q, k, v.view(n, c.num_kv_heads, d), gate
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        if c.qk_norm_full and lw.q_norm is not None and lw.k_norm is not None:
            # OLMoE: RMSNorm over the whole projection, before the split into heads
            q = rms_norm(q, lw.q_norm, c.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, c.rms_norm_eps)
        q = q.view(n, c.num_heads, d)
        k = k.view(n, c.num_kv_heads, d)
        v = v.view(n, c.num_kv_heads, d)
        if lw.q_norm is not None and lw.k_norm is not None and not c.qk_norm_full:
            q = rms_norm(q, lw.q_norm, c.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, c.rms_norm_eps)
        if cos_sin is None:  # a layer without RoPE (SmolLM3)
            return q, k, v, gate
        cos, sin = cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _mla_qkv(
        self,
        layer: int,
        lw: LayerWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-head latent attention's inputs (see MlaConfig): x [N, hidden] -> the query in
        latent space [N, H, kv_lora_rank + rope], the cached key [N, 1, kv_lora_rank + rope]
        (the normed latent, then the shared key after RoPE) and no values of its own [N, 1, 0]
        (sdpa reads the latent as the values)."""
        c = self.config
        m, mw = c.mla, lw.mla
        assert m is not None and mw is not None and lw.qkv is not None
        n, r = x.shape[0], m.kv_lora_rank
        first = self._linear(layer, 0, lw.qkv, rms_norm(x, lw.input_norm, c.rms_norm_eps))
        q, latent, k_rope = first.split([first.shape[-1] - m.key_dim, r, m.rope_dim], dim=-1)
        if mw.q_b is not None:
            assert mw.q_norm is not None
            q = self._linear(layer, 4, mw.q_b, rms_norm(q, mw.q_norm, c.rms_norm_eps))
        q_nope, q_rope = q.view(n, c.num_heads, m.nope_dim + m.rope_dim).split(
            [m.nope_dim, m.rope_dim], dim=-1
        )
        cos, sin = cos_sin
        q_rope = apply_rope(q_rope, cos, sin)
        # each head's query through its key up-projection: [H, N, nope] @ [H, nope, r]
        q_latent = torch.bmm(q_nope.transpose(0, 1), mw.w_uk).transpose(0, 1)
        latent = rms_norm(latent, mw.kv_norm, c.rms_norm_eps)
        k_rope = apply_rope(k_rope.view(n, 1, m.rope_dim), cos, sin)
        k = torch.cat((latent.view(n, 1, r), k_rope), dim=-1)
        return torch.cat((q_latent, q_rope), dim=-1), k, k.new_empty(n, 1, 0)

    def _mla_output(self, mw: MlaWeights, attn: torch.Tensor) -> torch.Tensor:
        """Attention's weighted latents [N, H * kv_lora_rank] through each head's value
        up-projection -> [N, H * v_dim], what o_proj reads."""
        n, heads = attn.shape[0], mw.w_uv.shape[0]
        out = torch.bmm(attn.view(n, heads, -1).transpose(0, 1), mw.w_uv)  # [H, N, v_dim]
        return out.transpose(0, 1).reshape(n, heads * mw.w_uv.shape[2])

    def _finish_layer(
        self, layer: int, lw: LayerWeights, x: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Residual, MLP, residual. x: [N, hidden]; out: [N, hidden], the attention's (after
        its output projection) or the mixer's."""
        c = self.config
        if self.reduce is not None:
            out = self.reduce(out)
        x = self._residual(x, out, lw.attn_out_norm)
        normed = rms_norm(x, lw.post_norm, c.rms_norm_eps)
        if lw.moe is not None:  # routed experts in place of the dense MLP
            out = self._moe(layer, lw.moe, normed)
        else:
            assert lw.gate_up is not None and lw.down is not None
            gate, up = self._linear(layer, 2, lw.gate_up, normed).chunk(2, dim=-1)
            act = F.silu(gate) if c.act == "silu" else F.gelu(gate, approximate="tanh")
            out = self._linear(layer, 3, lw.down, act * up)
        if self.reduce is not None:
            out = self.reduce(out)
        return self._residual(x, out, lw.mlp_out_norm)

    def _residual(
        self, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None
    ) -> torch.Tensor:
        """x plus a block's output: normed first (Gemma's sandwich norms), scaled (Granite)."""
        c = self.config
        if norm is not None:
            out = rms_norm(out, norm, c.rms_norm_eps)
        if c.residual_scale != 1.0:
            out = out * c.residual_scale
        return x + out

    def sdpa(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        banded: torch.Tensor | None = None,
        form: AttentionForm = "step",
    ) -> torch.Tensor:
        """Attention over grouped queries (see group_queries): q [B, KVH, Q, D], k and v
        [B, KVH, L, D], mask broadcasting to [B, KVH, Q, L] (True = attend) -> [B, KVH, Q, D];
        `banded` is the mask instead in a sliding-window layer. `form`: what the call is, a
        decode or verify step's rows ("step"), one sequence's prompt chunk ("chunk") or
        packed whole sequences ("packed"). In the exact mode (see `exact`) steps and chunks
        run arch/exact.py's attention, whose result for a query does not depend on the batch,
        the padding or the chunking; else PyTorch's fused kernel, at the family's query scale,
        and with Gemma 2's soft-capped scores or gpt-oss's attention sinks (the kernel has
        neither) written out and softmaxed in float32."""
        c = self.config
        if c.window(layer) is not None:
            mask = banded
        if c.mla is not None:  # latent attention: the cached latent is the values
            v = k[..., : c.mla.kv_lora_rank]
        scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
        sinks = self.layers[layer].sinks  # gpt-oss: a logit per query head, or None
        if self.exact and form != "packed":
            exact_sinks = None if sinks is None else sinks.float()
            if form == "chunk":
                assert mask is not None  # a chunk's queries are causal
                return chunk_attention(q, k, v, mask, scale, c.attn_softcap, exact_sinks)
            tokens = q.shape[2] // c.group_size
            return step_attention(q, k, v, mask, scale, c.attn_softcap, tokens, exact_sinks)
        if c.attn_softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.attn_scale)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if c.attn_softcap is not None:
            scores = soft_cap(scores, c.attn_softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column of scores, in the softmax's sum only
            column = grouped_sinks(sinks.to(scores.dtype), c.num_kv_heads, q.shape[2])
            column = column[None, :, :, None].expand(*scores.shape[:-1], 1)
            scores = torch.cat((scores, column), dim=-1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if sinks is not None:
            weights = weights[..., :-1]
        return torch.matmul(weights, v)

    @functools.cached_property
    def exact(self) -> bool:
        """Whether attention runs exactly (arch/exact.py): on the CPU in float32, the parity
        contract's mode, unless NEURON_EXACT_ATTENTION=0 (to compare). Its products are exact
        by what the CPU's BLAS does, measured there; elsewhere attention is PyTorch's fused
        kernel, and a reply may change with the batch in its last bits."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and env_flag("NEURON_EXACT_ATTENTION")
        )

    def group_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H, D] -> [B, KVH, G * T, D]: each KV head's query heads side by side, so
        attention reads the shared K/V once instead of repeating it per query head."""
        b, t, _, d = q.shape
        c = self.config
        return q.transpose(1, 2).reshape(b, c.num_kv_heads, c.group_size * t, d)

    def _causal_mask(
        self, positions: torch.Tensor, columns: int, window: int | None = None
    ) -> torch.Tensor:
        """[G * T, columns] bool for queries at absolute `positions` [T] over the first
        `columns` KV columns: each sees the columns up to its own position (and, with a
        sliding `window`, none `window` or more behind it), in grouped query order (see
        group_queries)."""
        col = torch.arange(columns, device=positions.device)[None, :]
        causal = col <= positions[:, None]
        if window is not None:
            causal &= col > positions[:, None] - window
        return causal.repeat(self.config.group_size, 1)

    def _image_blocks(
        self,
        tokens: Sequence[int],
        start: int,
        total: int,
        mask: torch.Tensor,
        banded: torch.Tensor | None,
        window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`mask` and `banded` (a chunk's, of `tokens` at columns [start, total)) with each
        run of one image's tokens seeing the whole run, later tokens too (Gemma 3's
        bidirectional attention within an image; a sliding layer's window still bounds what
        lies behind). The run must lie whole in the chunk (the engine never cuts one)."""
        t = total - start
        block = torch.zeros(t, total, dtype=torch.bool, device=self.device)
        i = 0
        while i < t:
            if tokens[i] >= 0:
                i += 1
                continue
            j = past_image(tokens, i + 1)  # the end of this image's run
            block[i:j, start + i : start + j] = True
            i = j
        grouped = block.repeat(self.config.group_size, 1)
        mask = mask | grouped
        if banded is not None and window is not None:
            rows = torch.arange(start, total, device=self.device)[:, None]
            col = torch.arange(total, device=self.device)[None, :]
            near = (rows - col < window).repeat(self.config.group_size, 1)
            banded = banded | (grouped & near)
        return mask, banded

    def _sequence_attention(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        start: int,
        total: int,
        states: list[States] | None = None,
        capture: int | None = None,
        tokens: Sequence[int] | None = None,
    ) -> SequenceAttention:
        """A sequence's tokens at columns [start, total) of its own buffers (see
        SequenceAttention), with the banded mask of the sliding layers when there are any, its
        fixed-size `states`, and their copy after `capture` tokens when that lies within."""
        positions = torch.arange(start, total, device=self.device)
        window = self.config.sliding_window if self.config.windowed else None
        banded = None if window is None else self._causal_mask(positions, total, window)
        mask = self._causal_mask(positions, total)
        if self.bidirectional_images and tokens is not None and min(tokens) < 0:
            mask, banded = self._image_blocks(tokens, start, total, mask, banded, window)
        kept = None
        if capture is not None and start < capture < total and self.has_states:
            kept = (capture, [])
        return SequenceAttention(keys, values, start, total, mask, banded, states or [], kept)

    def ungroup(self, out: torch.Tensor, t: int) -> torch.Tensor:
        """[B, KVH, G * T, D] -> [B * T, H * D]."""
        b = out.shape[0]
        c = self.config
        out = out.reshape(b, c.num_heads, t, c.value_dim).transpose(1, 2)
        return out.reshape(b * t, c.num_heads * c.value_dim)

    # ---- prefill ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        past: KvSnapshot | None = None,
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
        *,
        reserve: int = 0,
        extend: bool = False,
        capture: int | None = None,
        media: Mapping[int, torch.Tensor] | None = None,
    ) -> tuple[KvSnapshot, torch.Tensor]:
        """Runs one sequence's new tokens (after `past`, if given) in chunks of `chunk_size`.

        Returns the snapshot of past + new tokens and the final-normed hidden states of the new
        tokens: [N, hidden]. `reserve`: allocate room for that many tokens in all, so that later
        calls with `extend` grow the snapshot in place. `extend`: `past` is consumed, and when
        its buffers have room the new columns are written into them rather than into a copy.
        `capture`: a token count at which the fixed-size states are kept too (the snapshot's
        `checkpoint`), for the prefix cache. (With fixed-size states, chunks of a multiple of
        STATE_BLOCK give the same bits as one chunk; others differ in the last bits.)
        `media`: the rows of the images whose media ids (neuronpy/media.py) the tokens hold,
        by image number (VisionTower.encode's).
        """
        c = self.config
        new = list(token_ids)
        if not new:
            raise ValueError("prefill needs at least one new token")
        start = past.length if past is not None else 0
        total = start + len(new)
        if total > c.context_len:
            raise ValueError(f"sequence of {total} tokens exceeds the context of {c.context_len}")
        dev = self.device
        keys, values = self._kv_buffers(past, total, reserve, extend)
        states = self._state_buffers(past, extend)
        ids, inserts = self._token_inputs(new, media)
        hidden_out = []
        checkpoint = _kept(states, start) if capture == start and self.has_states else None
        lo = 0
        while lo < len(new):
            hi = min(lo + chunk_size, len(new))
            if self.bidirectional_images:  # (an image's run of tokens in one chunk, whole)
                hi = past_image(new, hi)
            a, b = start + lo, start + hi  # absolute columns of this chunk
            chunk = self._sequence_attention(keys, values, a, b, states, capture, new[lo:hi])
            part = _inserts_within(inserts, lo, hi)
            hidden_out.append(self._run(ids[lo:hi], torch.arange(a, b, device=dev), chunk, part))
            if chunk.capture is not None:
                checkpoint = chunk.capture
            elif capture == b and self.has_states:
                checkpoint = _kept(states, b)
            lo = hi
        return snapshot_of(keys, values, past, new, states, checkpoint), torch.cat(hidden_out)

    def _token_inputs(
        self, tokens: Sequence[int], media: Mapping[int, torch.Tensor] | None
    ) -> tuple[torch.Tensor, Inserts | None]:
        """Token ids [N] for the embedding, and the rows an image's tower output takes (its
        media ids, resolved through `media`; their ids become 0)."""
        if min(tokens) >= 0:
            return torch.tensor(tokens, dtype=torch.long, device=self.device), None
        rows, values = [], []
        for i, t in enumerate(tokens):
            if t < 0:
                number, j = split_media_id(t)
                found = None if media is None else media.get(number)
                if found is None or j >= found.shape[0]:
                    raise ValueError("a media id in the tokens names no image row given")
                rows.append(i)
                values.append(found[j])
        ids = torch.tensor([max(t, 0) for t in tokens], dtype=torch.long, device=self.device)
        where = torch.tensor(rows, dtype=torch.long, device=self.device)
        return ids, (where, torch.stack(values).to(self.device, self.dtype))

    def _state_buffers(self, past: KvSnapshot | None, extend: bool) -> list[States]:
        """The fixed-size states a sequence's next tokens advance: past's own when `extend`
        (it is consumed), a copy of them otherwise, or zeros from the start."""
        if not self.has_states:
            return []
        if past is None:
            return [self.zero_states(i) for i, lw in enumerate(self.layers) if lw.mixer]
        if len(past.states) != self.num_state_layers:
            raise ValueError("the snapshot holds no fixed-size states of this model's layers")
        if extend:
            return past.states
        return [tuple(t.clone() for t in st) for st in past.states]

    def _kv_buffers(
        self, past: KvSnapshot | None, total: int, reserve: int, extend: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V buffers for a sequence of `total` tokens whose first ones are
        `past`'s: past's own buffers when `extend` and they have room, else new ones of
        max(total, reserve) columns with past copied in."""
        c = self.config
        if extend and past is not None and past.buffers and past.capacity >= total:
            return past.buffers  # the prefix is in place already
        capacity = min(max(total, reserve), c.context_len)
        keys, values = (
            [
                torch.empty(1, c.num_kv_heads, capacity, dim, device=self.device, dtype=self.dtype)
                for _ in range(self.num_kv_layers)
            ]
            for dim in (c.head_dim, c.cached_value_dim)
        )
        if capacity > total:  # room to grow into: zeroed, as a live batch's headroom is
            for t in (*keys, *values):
                t[:, :, total:].zero_()
        if past is not None:
            start = past.length
            for layer in range(self.num_kv_layers):
                keys[layer][:, :, :start] = past.keys[layer]
                values[layer][:, :, :start] = past.values[layer]
        return keys, values

    # ---- pooling (embeddings) -----------------------------------------------------------------

    @torch.inference_mode()
    def pooled(
        self, sequences: Sequence[Sequence[int]], pooling: str, normalize: bool
    ) -> torch.Tensor:
        """Each sequence's final-normed hidden states pooled into one vector, keeping no KV:
        [len(sequences), hidden] float32, in the order given. `pooling`: "last" (the last
        token's, as decoder embedding models such as Qwen3-Embedding pool), "mean" (over the
        sequence's tokens) or "cls" (the first token's); `normalize`: to unit L2 norm.

        The sequences go through the layers packed, one forward of all their tokens (sorted
        by length, so that each length's attention is one call); a sequence's vector does
        not depend on which others it is packed with, but to the last bits of float rounding
        (the linear layers' blocking follows the number of tokens)."""
        if not sequences or any(not s for s in sequences):
            raise ValueError("pooling needs sequences of at least one token")
        c = self.config
        longest = max(len(s) for s in sequences)
        if longest > c.context_len:
            raise ValueError(f"sequence of {longest} tokens exceeds the context of {c.context_len}")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        lengths = [len(sequences[i]) for i in order]
        runs = [(length, n) for length, n in Counter(lengths).items()]  # (sorted: adjacent)
        dev = self.device
        ids = torch.tensor([t for i in order for t in sequences[i]], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(length, device=dev) for length in lengths])
        window = c.sliding_window if c.windowed else None
        masks, banded = {}, {}
        for length, _ in runs:
            at = torch.arange(length, device=dev)
            masks[length] = self._causal_mask(at, length)
            if window is not None:
                banded[length] = self._causal_mask(at, length, window)
        hidden = self._run(ids, positions, PackedAttention(runs, masks, banded)).float()
        ends = torch.tensor(lengths, device=dev).cumsum(0)
        if pooling == "last":
            vectors = hidden[ends - 1]
        elif pooling == "cls":
            vectors = hidden[ends - torch.tensor(lengths, device=dev)]
        elif pooling == "mean":
            vectors = torch.stack([h.mean(0) for h in hidden.split(lengths)])
        else:
            raise ValueError(f"unknown pooling {pooling!r}: last, mean or cls")
        if normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        out = torch.empty_like(vectors)
        out[torch.tensor(order, device=dev)] = vectors
        return out

    @torch.inference_mode()
    def pair_logits(self, sequences: Sequence[Sequence[int]], ids: Sequence[int]) -> torch.Tensor:
        """The logits of tokens `ids` after each sequence (its last position), keeping no KV:
        [len(sequences), len(ids)] float32 (a reranker's "no" and "yes"). Packed as `pooled`."""
        last = self.pooled(sequences, "last", False).to(self.dtype)
        return self.logits(last)[:, list(ids)]

    # ---- lockstep decode ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch_decode(self, batch: KvBatch, tokens: torch.Tensor) -> torch.Tensor:
        """One lockstep decode step: tokens [B, 1] -> final-normed hidden [B, hidden]."""
        return self.forward_step(batch, tokens).hidden

    @torch.inference_mode()
    def forward_step(
        self,
        batch: KvBatch,
        tokens: torch.Tensor,
        chunks: Sequence[PrefillChunk] = (),
        counts: Sequence[int] | None = None,
    ) -> StepOutput:
        """One lockstep decode step over the live batch, and optionally prefill chunks of
        sequences entering the batch, in the same forward.

        `tokens`: [B, 1], one per row; or, with `counts`, [N] flat: row b's counts[b] >= 1
        tokens one after another (its next token, then drafts to verify), at its own next
        positions, each seeing its row's columns and the row's tokens before it. The hidden
        states are then [N, hidden], in that order, and row b advances by counts[b] columns
        (`KvBatch.trim` gives back those a verification rejects).

        Every linear layer runs once over all decode tokens and every chunk's tokens together,
        so a chunk does not read the weights a second time. Attention runs per KV group for
        the decode rows (each group writes its rows' new K/V into its next columns, in place,
        and attends with its own padding mask) and causally over each chunk's own snapshot for
        that chunk.
        """
        c = self.config
        b = batch.batch_size
        if counts is None:
            if tokens.shape != (b, 1):
                raise ValueError(f"tokens must be [{b}, 1], got {list(tokens.shape)}")
            counts = [1] * b
            flat_tokens = tokens[:, 0]
        else:
            if len(counts) != b or min(counts, default=1) < 1 or tokens.shape != (sum(counts),):
                raise ValueError(f"tokens must be [{sum(counts)}] for {b} rows' {list(counts)}")
            flat_tokens = tokens
        if max(n + k for n, k in zip(batch.row_lengths, counts, strict=True)) > c.context_len:
            raise ValueError(f"a row would exceed the context of {c.context_len} tokens")
        n_dec = int(flat_tokens.shape[0])
        steps, at, first = [], 0, 0  # first: the group's first token in the forward
        for group in batch.groups:
            part = counts[at : at + group.batch_size]
            steps.append(self._group_step(group, part, first))
            at += len(part)
            first += sum(part)
        # RoPE positions and token ids of every token of the forward: decode rows, then chunks
        positions = [s.positions for s in steps]
        ids = [flat_tokens]
        spans: list[SequenceAttention] = []  # each chunk's
        kept: list[tuple[int, list[States]] | None] = []  # states kept at a chunk's start
        inserts: list[Inserts] = []  # the chunks' image rows, by their row in the forward
        for chunk in chunks:
            new = list(chunk.token_ids)
            start = chunk.past.length if chunk.past is not None else 0
            total = start + len(new)
            if not new or total > c.context_len:
                raise ValueError(f"a prefill chunk of {len(new)} tokens after {start} does not fit")
            keys, values = self._kv_buffers(chunk.past, total, chunk.reserve, chunk.extend)
            states = self._state_buffers(chunk.past, chunk.extend)
            at_start = chunk.capture == start and self.has_states
            kept.append(_kept(states, start) if at_start else None)
            positions.append(torch.arange(start, total, device=self.device))
            chunk_ids, chunk_inserts = self._token_inputs(new, chunk.media)
            if chunk_inserts is not None:
                at_row = sum(int(t.shape[0]) for t in ids)
                inserts.append((chunk_inserts[0] + at_row, chunk_inserts[1]))
            ids.append(chunk_ids)
            spans.append(
                self._sequence_attention(
                    keys, values, start, total, states, chunk.capture, chunk.token_ids
                )
            )
        rows = torch.cat(positions) if len(positions) > 1 else positions[0]
        flat = torch.cat(ids) if len(ids) > 1 else ids[0]
        given = None
        if inserts:
            given = (torch.cat([i[0] for i in inserts]), torch.cat([i[1] for i in inserts]))
        hidden = self._run(flat, rows, StepAttention(steps, spans), given)  # [N + n, hidden]
        for step in steps:
            step.advance()
        at = 0
        fed = flat_tokens.tolist()
        for row, n in zip(batch.token_ids, counts, strict=True):
            row.extend(fed[at : at + n])
            at += n
        if not chunks:
            return StepOutput(hidden)
        lasts, at = [], n_dec
        for span in spans:
            at += span.tokens
            lasts.append(at - 1)
        last = hidden[torch.tensor(lasts, device=self.device)]  # [chunks, hidden]
        snapshots = tuple(
            snapshot_of(
                r.keys,
                r.values,
                chunk.past,
                list(chunk.token_ids),
                r.states,
                r.capture or before or self._at_end(chunk, r),
            )
            for chunk, r, before in zip(chunks, spans, kept, strict=True)
        )
        return StepOutput(hidden[:n_dec], snapshots, tuple(last))

    def _at_end(
        self, chunk: PrefillChunk, span: SequenceAttention
    ) -> tuple[int, list[States]] | None:
        """The checkpoint of a chunk asked to keep its states at its own end."""
        if chunk.capture != span.total or not self.has_states:
            return None
        return _kept(span.states, span.total)

    def _group_step(self, group: KvGroup, counts: Sequence[int], first: int) -> GroupStep:
        """What one step does in one group, whose rows' tokens start at `first` of the
        forward: one column per row in place when every row feeds one token and holds all the
        group's steps (the lockstep case), else a ragged write and mask (RaggedStep)."""
        if not group.record:  # (a verify step's states: `trim` has used them, or never will)
            group.history = None
        if group.uniform and all(n == 1 for n in counts):
            group.ensure_headroom(1)
            positions = group.positions()
            banded = None
            if self.config.windowed:
                assert self.config.sliding_window is not None
                banded = window_decode_mask(group, positions, self.config.sliding_window)
            return UniformStep(group, first, group.decode_mask(), positions, banded)
        return RaggedStep.plan(self, group, counts, first)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in float32."""
        with torch.inference_mode():
            out = self.lm_head(hidden).float()
            if self._refines_logits:
                out = self._refine(hidden, out)
            c = self.config
            if c.logits_scale != 1.0:  # Granite
                out = out / c.logits_scale
            if c.final_softcap is not None:  # Gemma 2
                out = soft_cap(out, c.final_softcap)
            return out

    @property
    def _refines_logits(self) -> bool:
        """A quantized head tied to a quantized embedding: its logits come out of the kernel in
        bf16, 0.125 apart at 25, coarser than the gap between two candidates often is (the
        default model's first token for "What is the capital of France?": "The" 25.33, "L"
        25.24 in fp32, both 25.125 in bf16). The embedding holds the same weights exactly."""
        return (
            self.config.tie_word_embeddings
            and isinstance(self.embed, QuantEmbedding)
            and not isinstance(self.lm_head, Linear)
            and getattr(self.lm_head, "out_features", 0) == self.config.vocab_size
        )

    def _refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The REFINED_LOGITS leading logits of each row computed again in fp32 from the
        embedding's exact rows: what greedy picks and the head of what sampling draws from are
        fp32; the tail keeps the kernel's bf16. Row by row, so batched == alone still holds."""
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        out = logits.reshape(-1, logits.shape[-1])
        top = out.topk(min(REFINED_LOGITS, out.shape[-1]), dim=-1).indices  # [R, k]
        rows = self.embed.rows(top.reshape(-1), torch.float32)  # type: ignore[union-attr]
        exact = (rows.reshape(*top.shape, -1) * flat[:, None, :]).sum(-1)
        return out.scatter(1, top, exact).reshape(logits.shape)


# each dense layer's projections, by the module names of a checkpoint that take_weights looks
# their ranges up by (the fused q/k/v and gate/up under their first part's name, or the fused
# one's where a checkpoint holds them fused)
PROJECTION_NAMES = {
    "qkv": ("self_attn.q_proj", "self_attn.qkv_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.gate_up_proj"),
    "down": ("mlp.down_proj",),
}


class _RangeRecorder:
    """A projection that records its input's largest absolute value per channel."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], seen: list[torch.Tensor]):
        self.inner = inner
        self.seen = seen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        top = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        self.seen[0] = top if not len(self.seen[0]) else torch.maximum(self.seen[0], top)
        return self.inner(x)


def measure_input_ranges(model: LlamaModel, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """The int8 mode's calibration on a model of neuronpy's own (a GGUF file's, its weights as
    stored, where no transformers model is at hand): each dense layer's projections' and the
    LM head's largest absolute input per channel over `token_ids`, by the checkpoint's module
    names (what take_weights' `input_ranges` takes). Runs the model eagerly, once."""
    if model.compiled:
        raise ValueError("measure_input_ranges runs a model that is not compiled")
    found: dict[str, list[torch.Tensor]] = {}
    swapped: list[tuple[Any, str, Any]] = []

    def record(owner: Any, attr: str, names: Sequence[str]) -> None:
        inner = getattr(owner, attr)
        if inner is None:
            return
        seen = [torch.empty(0)]
        for name in names:
            found[name] = seen
        swapped.append((owner, attr, inner))
        setattr(owner, attr, _RangeRecorder(inner, seen))

    for i, lw in enumerate(model.layers):
        for attr, names in PROJECTION_NAMES.items():
            record(lw, attr, [f"model.layers.{i}.{name}" for name in names])
    record(model, "lm_head", ["lm_head"])
    try:
        with torch.inference_mode():
            model.logits(model.prefill(list(token_ids))[1])
    finally:
        for owner, attr, inner in swapped:
            setattr(owner, attr, inner)
    return {name: seen[0] for name, seen in found.items() if len(seen[0])}


def _kept(states: list[States], at: int) -> tuple[int, list[States]]:
    """A copy of a sequence's fixed-size states after its first `at` tokens (a checkpoint)."""
    return at, [tuple(t.clone() for t in st) for st in states]


def _pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """`out` with zero rows up to `rows`: for the copy a lone token runs the compiled graph
    with (see LlamaModel._run)."""
    if rows == out.shape[0]:
        return out
    return torch.cat((out, out.new_zeros(rows - out.shape[0], out.shape[1])))


def _inserts_within(inserts: Inserts | None, lo: int, hi: int) -> Inserts | None:
    """The inserts of rows [lo, hi), their rows counted from lo."""
    if inserts is None:
        return None
    rows, values = inserts
    keep = (rows >= lo) & (rows < hi)
    if not bool(keep.any()):
        return None
    return rows[keep] - lo, values[keep]
