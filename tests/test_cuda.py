"""The parity contract on CUDA, in float32 and bfloat16: our forward against transformers', the
ragged lockstep batch against each row alone, the worker's jobs, and the engine's concurrent
requests against one at a time. Skipped where there is no CUDA device.

In float32 greedy output is byte-identical batched and alone, as on the CPU. In bfloat16 the
kernels a (B, 1) step and a (1, 1) step run may round differently, so the contract there is on
the logits (close within bfloat16's precision) and on the first tokens of each reply."""

from __future__ import annotations

import copy
from typing import Any

import anyio
import pytest
import torch

from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.types import Completion, SamplingParams
from tests.factories import FAMILIES, hf_model, tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DTYPES = {"float32": (torch.float32, 2e-4), "bfloat16": (torch.bfloat16, 6e-2)}
PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33], [60])


def on_cuda(name: str, dtype: torch.dtype) -> Any:
    """A copy of the fixture's transformers model on the GPU in `dtype`."""
    return copy.deepcopy(hf_model(name)).to(device="cuda", dtype=dtype).eval()


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_prefill_matches_transformers(name: str, dtype_name: str) -> None:
    dtype, atol = DTYPES[dtype_name]
    reference = on_cuda(name, dtype)
    model = LlamaModel.from_hf(reference)
    ids = PROMPTS[2] + PROMPTS[0]
    _, hidden = model.prefill(ids, chunk_size=5)
    with torch.no_grad():
        expected = reference(torch.tensor([ids], device="cuda")).logits[0]
    torch.testing.assert_close(model.logits(hidden).float(), expected.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_cuda_ragged_lockstep_matches_each_row_alone(dtype_name: str) -> None:
    dtype, atol = DTYPES[dtype_name]
    model = LlamaModel.from_hf(on_cuda("tiny-llama", dtype))
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS])
    solo = [assemble_batch([model.prefill(p)[0]]) for p in PROMPTS]
    tokens = [p[-1] for p in PROMPTS]
    for _ in range(5):
        step = torch.tensor([[t] for t in tokens], device="cuda")
        together = model.logits(model.forward_batch_decode(batch, step)).float()
        for row, alone_batch in enumerate(solo):
            alone = model.logits(
                model.forward_batch_decode(alone_batch, step[row : row + 1])
            ).float()
            torch.testing.assert_close(together[row], alone[0], atol=atol, rtol=atol)
            if dtype is torch.float32:
                assert int(together[row].argmax()) == int(alone[0].argmax())
        tokens = [int(t) for t in together.argmax(dim=-1)]


async def _completions(engine: Any, jobs: list[tuple[list[int], SamplingParams]], together: bool):
    if not together:
        return [await engine.complete(*job) for job in jobs]
    results: list[Completion | None] = [None] * len(jobs)

    async def one(i: int) -> None:
        await anyio.sleep(i * 0.01)  # staggered: rows join mid-flight
        results[i] = await engine.complete(*jobs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    return results


@pytest.mark.anyio
@pytest.mark.parametrize("dtype_name", DTYPES)
async def test_cuda_engine_concurrent_matches_sequential(dtype_name: str) -> None:
    dtype, _ = DTYPES[dtype_name]
    tok = tokenizer("tiny-llama")
    texts = ["The quick brown fox", "café au lait", "Numbers: 1, 2, 3", "Hello", "日本語"]
    jobs = [(tok.encode(t), SamplingParams(max_tokens=24, temperature=0.0)) for t in texts]
    engine = engine_from_hf(on_cuda("tiny-llama", dtype), tok, name="cuda", config=EngineConfig())
    async with engine:
        alone = await _completions(engine, jobs, together=False)
        batched = await _completions(engine, jobs, together=True)
        assert engine.stats().max_batch_size > 1
    for a, b in zip(alone, batched, strict=True):
        if dtype is torch.float32:
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        else:  # bfloat16: the replies agree at least where the logits are not near a tie
            assert a.token_ids[:4] == b.token_ids[:4]
