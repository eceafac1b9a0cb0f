"""transformers' continuous batching as a peer: the manager `model.generate_batch` runs."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from neuronpy.bench.records import ProfiledSteps, RunOutput, Trace, span
from neuronpy.bench.systems import HF_CB, PEER_HELP, WARMUP_TOKENS
from neuronpy.bench.workloads import UNCONSTRAINED, BenchRequest, Workload


class HfContinuousBatching:
    """transformers' continuous batching: the manager `model.generate_batch` runs, here started
    per run (its KV cache sized to the workload), warmed up with a short request, then fed each
    request at its arrival time. Token times are the manager's own (record_timestamps)."""

    workloads = UNCONSTRAINED  # it has no constrained decoding

    def __init__(
        self, name: str, hf_model: Any, *, max_batch_tokens: int = 512, page_size: int = 256
    ):
        self.name = name
        self.description = PEER_HELP[HF_CB]
        self._model = hf_model
        self.max_batch_tokens = max_batch_tokens
        self.page_size = page_size

    def start(self, warmup: Workload) -> None:
        pass  # each run starts its own manager and warms it up first

    def _blocks(self, requests: Sequence[BenchRequest]) -> int:
        page = self.page_size
        need = sum(math.ceil((len(r.prompt_ids) + r.max_tokens) / page) + 1 for r in requests)
        return need + 4  # and the warm-up request

    def run(self, workload: Workload) -> RunOutput:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        requests = workload.requests
        cb_config = ContinuousBatchingConfig(
            num_blocks=self._blocks(requests),
            max_batch_tokens=max(self.max_batch_tokens, 64),
            page_size=self.page_size,
        )
        gen_config = GenerationConfig(
            do_sample=False, max_new_tokens=workload.max_output_len, eos_token_id=-1
        )
        hints = WorkloadHints(
            max_prompt_length=workload.max_prompt_len,
            max_generated_length=workload.max_output_len,
            num_requests=len(requests) + 1,
        )
        traces = [Trace(prompt_tokens=len(r.prompt_ids), tag=r.tag) for r in requests]
        with self._model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            block=True,
            timeout=60,
            warmup=False,
            workload_hints=hints,
        ) as manager:
            warm = list(requests[0].prompt_ids[:32])
            manager.add_request(
                warm, request_id="warmup", max_new_tokens=WARMUP_TOKENS, eos_token_id=-1
            )
            while True:
                result = manager.get_result(timeout=1)
                if result is not None and result.request_id == "warmup" and result.is_finished():
                    break
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died in warm-up")
            self._feed(manager, workload, traces)
        records = tuple(t.record() for t in traces)
        return RunOutput(records, span(records))

    def _feed(self, manager: Any, workload: Workload, traces: list[Trace]) -> None:
        """Adds each request at its arrival (a gated one once its join condition holds) and
        collects the results until every request has finished or the manager has stopped."""
        requests = workload.requests
        streaming = workload.triggered  # partial results only to know when a join is due
        progress = [0] * len(requests)
        finished = [False] * len(requests)
        waiting = sorted(
            (i for i, r in enumerate(requests) if r.after_tokens is None),
            key=lambda i: requests[i].arrival,
        )
        gated = [i for i, r in enumerate(requests) if r.after_tokens is not None]
        t0 = time.perf_counter()

        def add(i: int) -> None:
            r = requests[i]
            traces[i].sent = time.perf_counter() - t0
            manager.add_request(
                list(r.prompt_ids),
                request_id=f"r{i}",
                max_new_tokens=r.max_tokens,
                streaming=streaming,
                record_timestamps=True,
                eos_token_id=-1,
            )

        done = 0
        while done < len(requests):
            now = time.perf_counter() - t0
            while waiting and requests[waiting[0]].arrival <= now:
                add(waiting.pop(0))
            for j in list(gated):
                need = requests[j].after_tokens or 0
                if all(finished[i] or progress[i] >= need for i in range(j) if i not in gated):
                    gated.remove(j)
                    add(j)
            wait = 0.05
            if waiting:
                wait = min(wait, max(0.001, requests[waiting[0]].arrival - now))
            result = manager.get_result(timeout=wait)
            if result is None:
                if not manager.is_running():
                    for i, trace in enumerate(traces):
                        if not finished[i]:
                            trace.error = "transformers' continuous batching loop stopped"
                    return
                continue
            if not result.request_id.startswith("r"):
                continue
            i = int(result.request_id[1:])
            progress[i] = len(result.generated_tokens)
            if not result.is_finished() or finished[i]:
                continue
            finished[i] = True
            done += 1
            trace = traces[i]
            trace.token_ids = list(result.generated_tokens)
            trace.output_tokens = len(trace.token_ids)
            trace.chunk_times = [ts - t0 for ts in (result.timestamps or [])]
            if result.error is not None:
                trace.error = str(result.error)[:300]

    def profile(self, workload: Workload) -> ProfiledSteps | None:
        return None

    def close(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "drive": "in-process",
            "max_batch_tokens": self.max_batch_tokens,
            "page_size": self.page_size,
            "num_blocks": "sized to each workload",
        }
