"""transformers' `model.generate()` as a peer: one request at a time, or static batches."""

from __future__ import annotations

import time
from typing import Any

from neuronpy.bench.records import ProfiledSteps, RunOutput, Trace, span
from neuronpy.bench.systems import HF_SERIAL, HF_STATIC, PEER_HELP
from neuronpy.bench.workloads import Workload


class _TimingStreamer:
    """A transformers streamer that only records when each generated token arrives. The first
    `put` is the prompt; each later one is one step's token(s) for every row."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def pad_id(hf_model: Any, tokenizer: Any) -> int:
    """The id to left-pad with: the pad token, else the (first) EOS token, else 0."""
    for source in (tokenizer, getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    for source in (tokenizer, getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value:
            return int(value[0])
    return 0


def eos_ids(hf_model: Any) -> list[int]:
    """Every EOS id the model's configs name."""
    out: list[int] = []
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, int))
    return sorted(set(out))


class HfGenerate:
    """`model.generate()` in greedy mode, EOS ignored (min_new_tokens = max_new_tokens). Serial:
    one request at a time, in arrival order. Static: left-padded batches taken in arrival order,
    K wide in W1 (else `batch_size` wide), each running to its longest request."""

    workloads = frozenset({"W1", "W2", "W3"})

    def __init__(self, name: str, hf_model: Any, tokenizer: Any, *, static: bool, batch_size: int):
        self.name = name
        self.static = static
        self.batch_size = batch_size
        self.description = PEER_HELP[HF_STATIC if static else HF_SERIAL]
        self._model = hf_model
        self._pad = pad_id(hf_model, tokenizer)
        self._eos = eos_ids(hf_model)

    def start(self, warmup: Workload) -> None:
        self.run(warmup)

    def run(self, workload: Workload) -> RunOutput:
        import torch
        from transformers import GenerationConfig

        requests = workload.requests
        width = 1 if not self.static else (workload.concurrency or self.batch_size)
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        traces = [Trace(prompt_tokens=len(r.prompt_ids), sent=r.arrival) for r in requests]
        device = self._model.device
        t0 = time.perf_counter()
        for at in range(0, len(order), width):
            group = order[at : at + width]
            ready = max(requests[i].arrival for i in group)
            delay = t0 + ready - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            longest = max(len(requests[i].prompt_ids) for i in group)
            ids = [
                [self._pad] * (longest - len(requests[i].prompt_ids)) + list(requests[i].prompt_ids)
                for i in group
            ]
            mask = [
                [0] * (longest - len(requests[i].prompt_ids)) + [1] * len(requests[i].prompt_ids)
                for i in group
            ]
            new = max(requests[i].max_tokens for i in group)
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=self._pad,
                eos_token_id=self._eos or None,
            )
            streamer = _TimingStreamer(t0)
            try:
                with torch.inference_mode():
                    out = self._model.generate(
                        input_ids=torch.tensor(ids, device=device),
                        attention_mask=torch.tensor(mask, device=device),
                        generation_config=config,
                        streamer=streamer,
                    )
            except Exception as exc:
                for i in group:
                    traces[i].error = f"{type(exc).__name__}: {exc}"[:300]
                continue
            for row, i in enumerate(group):
                n = requests[i].max_tokens
                trace = traces[i]
                trace.chunk_times = streamer.times[:n]
                trace.output_tokens = len(trace.chunk_times)
                trace.token_ids = out[row, longest : longest + n].tolist()
        records = tuple(t.record() for t in traces)
        return RunOutput(records, span(records))

    def profile(self, workload: Workload) -> ProfiledSteps | None:
        return None

    def close(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        width = f"K in W1, else {self.batch_size}" if self.static else 1
        return {"description": self.description, "drive": "in-process", "batch": width}
