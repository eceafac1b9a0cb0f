"""Worker parity: Prefill / Assemble / ForwardLogitsBatch / Extract jobs end to end, joins and a
leave-path rebatch included, == the sequential reference at every step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from neuronpy.arch.llama import LlamaModel
from neuronpy.errors import WorkerError
from neuronpy.worker.jobs import (
    AssembleKvBatch,
    DropKvSnapshot,
    ExtractKvRows,
    ForwardLogitsBatch,
    Prefill,
    WorkerStats,
)
from neuronpy.worker.worker import DeviceWorker
from tests.factories import hf_model

PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33])
LATE = [77, 78, 79, 80, 81]


@pytest.fixture
def worker() -> Iterator[DeviceWorker]:
    w = DeviceWorker(LlamaModel.from_hf(hf_model("tiny-qwen2")), prefill_chunk=4).start()
    yield w
    w.shutdown(timeout=10)


def run(worker: DeviceWorker, job: Any) -> Any:
    return worker.submit(job).result(timeout=30)


def reference(worker: DeviceWorker, ids: list[int]) -> torch.Tensor:
    """The sequential reference: the whole sequence prefilled alone; its last logits."""
    _, hidden = worker.model.prefill(ids)
    return worker.model.logits(hidden[-1])


@pytest.fixture(
    params=[
        "tiny-qwen2",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-qwen3-next",
        "tiny-lfm2",
        "tiny-deepseek-v3",
        "tiny-glm4-moe",
        "tiny-gpt-oss",
    ]
)
def family_worker(request: pytest.FixtureRequest) -> Iterator[DeviceWorker]:
    """A worker over one family's fixture (Gemma's sliding windows and soft-caps, Phi-3's
    partial rotary embeddings, the hybrids' fixed-size states, DeepSeek's latent cache,
    GLM-4.5's grouped routing, gpt-oss's attention sinks, through the jobs)."""
    w = DeviceWorker(LlamaModel.from_hf(hf_model(request.param)), prefill_chunk=4).start()
    yield w
    w.shutdown(timeout=10)


def test_parity_jobs_end_to_end_with_join_and_leave(family_worker: DeviceWorker) -> None:
    worker = family_worker
    seqs = [list(p) for p in PROMPTS]
    next_tokens = []
    for sid, p in enumerate(PROMPTS):
        res = run(worker, Prefill(sid, tuple(p)))
        assert res.length == len(p) and res.logits.device.type == "cpu"
        torch.testing.assert_close(res.logits, reference(worker, p), atol=1e-4, rtol=1e-4)
        next_tokens.append(int(res.logits.argmax()))
    assembled = run(worker, AssembleKvBatch((0, 1, 2)))
    assert (assembled.batch_size, assembled.padded_len) == (3, 11)
    assert assembled.padding_columns == (11 - 7) + (11 - 2)

    def step(expected_rows: int) -> None:
        out = run(worker, ForwardLogitsBatch(tuple(next_tokens)))
        assert out.logits.shape[0] == expected_rows and out.logits.dtype == torch.float32
        for row, seq in enumerate(seqs):
            seq.append(next_tokens[row])
            torch.testing.assert_close(
                out.logits[row], reference(worker, seq), atol=1e-4, rtol=1e-4
            )
            next_tokens[row] = int(out.logits[row].argmax())

    for _ in range(4):
        step(3)

    # leave: row 1 finishes; extract the two survivors, assemble them again, keep decoding
    lengths = run(worker, ExtractKvRows(rows=(0, 2), snapshot_ids=(10, 12))).lengths
    assert lengths == (len(seqs[0]), len(seqs[2]))
    del seqs[1], next_tokens[1]
    run(worker, AssembleKvBatch((10, 12)))
    for _ in range(3):
        step(2)

    # join: a late prompt prefills alone, then the batch is rebuilt with it as the last row
    res = run(worker, Prefill(20, tuple(LATE)))
    run(worker, ExtractKvRows(rows=(0, 1), snapshot_ids=(30, 31)))
    run(worker, AssembleKvBatch((30, 31, 20)))
    seqs.append(list(LATE))
    next_tokens.append(int(res.logits.argmax()))
    for _ in range(4):
        step(3)

    # everyone leaves: nothing is left behind
    run(worker, ExtractKvRows(rows=(), snapshot_ids=()))
    stats = run(worker, WorkerStats())
    assert (stats.snapshots, stats.live_batch_size, stats.snapshot_bytes) == (0, 0, 0)


def test_prefill_continues_from_a_parent_snapshot(worker: DeviceWorker) -> None:
    whole = PROMPTS[2]
    run(worker, Prefill(1, tuple(whole[:6])))
    res = run(worker, Prefill(2, tuple(whole[6:]), parent_id=1))
    assert res.length == len(whole)
    torch.testing.assert_close(res.logits, reference(worker, whole), atol=1e-4, rtol=1e-4)
    assert run(worker, DropKvSnapshot((1, 2, 99))).dropped == 2


def test_job_errors_come_back_through_the_future(worker: DeviceWorker) -> None:
    with pytest.raises(Exception, match="no live batch"):
        run(worker, ForwardLogitsBatch((1,)))
    with pytest.raises(Exception, match="unknown snapshots"):
        run(worker, AssembleKvBatch((404,)))
    # the worker keeps serving after a failed job
    assert run(worker, Prefill(1, (3, 4))).length == 2


def test_a_row_left_out_of_the_next_batch_keeps_its_kv(worker: DeviceWorker) -> None:
    """Extracted rows are copied straight into the next batch; one that batch leaves out gets
    storage of its own and still continues exactly (a preempted or parked sequence)."""
    for sid, p in enumerate(PROMPTS):
        run(worker, Prefill(sid, tuple(p)))
    run(worker, AssembleKvBatch((0, 1, 2)))
    run(worker, ForwardLogitsBatch((4, 5, 6)))
    run(worker, ExtractKvRows(rows=(0, 1, 2), snapshot_ids=(10, 11, 12)))
    run(worker, AssembleKvBatch((12, 10)))
    stats = run(worker, WorkerStats())
    assert (stats.snapshots, stats.live_batch_size) == (1, 2)
    assert stats.snapshot_bytes == worker._snapshots[11].nbytes > 0
    parked = [*PROMPTS[1], 5]
    res = run(worker, Prefill(13, (7,), parent_id=11))
    torch.testing.assert_close(res.logits, reference(worker, [*parked, 7]), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_with_reserve_extends_in_place(worker: DeviceWorker) -> None:
    whole = PROMPTS[2] * 2
    run(worker, Prefill(1, tuple(whole[:5]), reserve=len(whole)))
    run(worker, Prefill(1, tuple(whole[5:12]), parent_id=1))
    res = run(worker, Prefill(1, tuple(whole[12:]), parent_id=1))
    assert res.length == len(whole)
    torch.testing.assert_close(res.logits, reference(worker, whole), atol=1e-4, rtol=1e-4)
    assert run(worker, WorkerStats()).snapshots == 1


def test_parity_two_prompts_riding_one_step_then_joining(worker: DeviceWorker) -> None:
    """Two joiners' chunks in one ForwardLogitsBatch: one ends its prompt (logits), one does
    not; a step refuses two chunks filling one snapshot."""
    for sid, p in enumerate(PROMPTS[:2]):
        run(worker, Prefill(sid, tuple(p)))
    run(worker, AssembleKvBatch((0, 1)))
    seqs = [list(p) for p in PROMPTS[:2]]
    a, b = PROMPTS[2], [*LATE, *LATE]
    rides = (
        Prefill(7, tuple(a)),
        Prefill(8, tuple(b[:4]), reserve=len(b) + 4, logits=False),
    )
    out = run(worker, ForwardLogitsBatch((3, 4), prefills=rides))
    for row, seq in enumerate(seqs):
        seq.append((3, 4)[row])
        torch.testing.assert_close(out.logits[row], reference(worker, seq), atol=1e-4, rtol=1e-4)
    first, second = out.prefills
    torch.testing.assert_close(first.logits, reference(worker, a), atol=1e-4, rtol=1e-4)
    assert (first.length, second.length, second.logits) == (len(a), 4, None)
    out = run(worker, ForwardLogitsBatch((5, 6), prefills=(Prefill(8, tuple(b[4:]), parent_id=8),)))
    torch.testing.assert_close(out.prefills[0].logits, reference(worker, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(WorkerError, match="different snapshots"):
        run(worker, ForwardLogitsBatch((5, 6), prefills=(Prefill(9, (1,)), Prefill(9, (2,)))))
    run(worker, ExtractKvRows((0, 1), (10, 11)))
    run(worker, AssembleKvBatch((10, 7, 11, 8)))
    out = run(worker, ForwardLogitsBatch((1, 2, 3, 4)))
    for row, seq in enumerate(([*seqs[0], 5, 1], [*a, 2], [*seqs[1], 6, 3], [*b, 4])):
        torch.testing.assert_close(out.logits[row], reference(worker, seq), atol=1e-4, rtol=1e-4)


def test_parity_a_prompt_prefilled_riding_decode_steps(worker: DeviceWorker) -> None:
    """A joiner's whole prompt rides ForwardLogitsBatch jobs chunk by chunk: its first chunk
    after a prefix of another snapshot (copied), its middle ones growing it in place without
    logits, its last answering its logits; the rows' logits are those of plain decode steps."""
    for sid, p in enumerate(PROMPTS[:2]):
        run(worker, Prefill(sid, tuple(p)))
    run(worker, AssembleKvBatch((0, 1), keep_snapshots=True))  # 0 stays, as a parent
    seqs = [list(p) for p in PROMPTS[:2]]
    joiner = [*PROMPTS[0][:4], *PROMPTS[2]]  # starts like row 0's prompt
    reserve = len(joiner) + 4
    chunks = [
        Prefill(9, tuple(joiner[4:8]), parent_id=0, parent_length=4, reserve=reserve, logits=False),
        Prefill(9, tuple(joiner[8:12]), parent_id=9, logits=False),
        Prefill(9, tuple(joiner[12:]), parent_id=9),
    ]
    for chunk in chunks:
        tokens = (3, 4)
        out = run(worker, ForwardLogitsBatch(tokens, prefills=(chunk,)))
        for row, seq in enumerate(seqs):
            seq.append(tokens[row])
            torch.testing.assert_close(
                out.logits[row], reference(worker, seq), atol=1e-4, rtol=1e-4
            )
        if chunk.logits:
            assert out.prefills[0].length == len(joiner)
            torch.testing.assert_close(
                out.prefills[0].logits, reference(worker, joiner), atol=1e-4, rtol=1e-4
            )
        else:
            assert out.prefills[0].logits is None
    # it joins the batch as any prefilled snapshot does
    run(worker, ExtractKvRows((0, 1), (10, 11)))
    run(worker, AssembleKvBatch((10, 11, 9)))
    out = run(worker, ForwardLogitsBatch((5, 6, 7)))
    torch.testing.assert_close(out.logits[2], reference(worker, [*joiner, 7]), atol=1e-4, rtol=1e-4)
