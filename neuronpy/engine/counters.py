"""The engine's counters (typed, kept by the scheduler) and the stats snapshot built from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    """Cumulative counts since the engine started."""

    admitted: int = 0
    rejected: int = 0  # refused at admission: the queue was full
    timed_out: int = 0  # admitted, then waited past queue_timeout without getting a row
    cancelled: int = 0  # ended by the client before finishing
    finished: int = 0  # ended on their own (stop, length) or aborted by shutdown
    failed: int = 0
    prompt_tokens: int = 0  # of admitted requests
    generated_tokens: int = 0  # sampled tokens, over every request
    decode_steps: int = 0
    decoded_rows: int = 0  # sum of the batch size over decode steps
    multi_row_steps: int = 0  # decode steps with more than one row
    max_batch_size: int = 0  # the largest batch a decode step has run
    rebatches: int = 0
    prefills: int = 0
    prefill_chunks: int = 0  # prefill jobs: a long prompt joining mid-batch takes several
    riding_chunks: int = 0  # of those, chunks that rode a decode step
    prefill_tokens: int = 0  # prompt tokens actually prefilled (a prefix-cache hit's not)
    padded_kv_columns: int = 0  # padding-gap KV columns, summed over decode steps
    kv_columns: int = 0  # real KV columns attended, summed over decode steps
    prefix_cache_hits: int = 0
    prefix_cache_misses: int = 0
    prefix_cache_reused_tokens: int = 0
    preemptions: int = 0
    max_kv_tokens: int = 0  # the most KV a decode step has held (running rows and joiners)
    sessions_saved: int = 0
    sessions_restored: int = 0
    session_save_failures: int = 0  # finished requests whose session file could not be written
    # speculative decoding: rows of decode steps that verified drafts, the drafts they fed,
    # the drafts that stood, and the tokens those rows emitted (drafts that stood and one more)
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    # tokens a row's grammar forced (jump-forward) that a step fed beside the row's own
    jump_forward_tokens: int = 0
    # cumulative seconds
    timing: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("forward", "prefill", "rebatch", "sampling", "draft"), 0.0
        )
    )
    batch_size_steps: dict[int, int] = field(default_factory=dict)  # decode steps by batch size
    # one-row steps by why: no other request, the others still prefilling, or still queued
    alone_steps: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("no_peer", "peer_prefilling", "peer_queued"), 0)
    )

    def count_step(self, rows: int, padding: int, kv: int, held: int, alone: str | None) -> None:
        """Records one decode step of `rows` rows."""
        self.decode_steps += 1
        self.decoded_rows += rows
        self.multi_row_steps += rows > 1
        self.max_batch_size = max(self.max_batch_size, rows)
        self.batch_size_steps[rows] = self.batch_size_steps.get(rows, 0) + 1
        if alone is not None:
            self.alone_steps[alone] += 1
        self.padded_kv_columns += padding
        self.kv_columns += kv
        self.max_kv_tokens = max(self.max_kv_tokens, held)


@dataclass(frozen=True)
class EngineStats:
    running: int  # rows in (or about to join) the live batch
    queued: int
    live_batch_size: int
    max_batch_size: int  # the largest batch a decode step has run
    decode_steps: int
    decoded_rows: int  # sum of the batch size over decode steps
    multi_row_steps: int  # decode steps with more than one row
    rebatches: int
    prefills: int
    prefill_chunks: int  # prefill jobs: a long prompt joining mid-batch takes several
    riding_chunks: int  # of those, chunks that rode a decode step (no weight reads of their own)
    admitted: int
    rejected: int  # refused at admission: the queue was full
    timed_out: int  # admitted, then waited past queue_timeout without getting a row
    cancelled: int  # ended by the client (or a stop string's router) before finishing
    finished: int  # ended on their own (stop, length) or aborted by shutdown
    failed: int
    prompt_tokens: int  # of admitted requests
    generated_tokens: int  # sampled tokens, over every request
    healthy: bool
    padded_kv_columns: int  # padding-gap KV columns, summed over decode steps (batching's waste)
    kv_columns: int  # real KV columns attended, summed over decode steps
    timing: dict[str, float]  # cumulative seconds: forward, prefill, rebatch, sampling
    batch_size_steps: dict[int, int]  # decode steps by their batch size
    alone_steps: dict[str, int]  # one-row steps by why: no_peer, peer_prefilling, peer_queued
    prefill_tokens: int = 0  # prompt tokens actually prefilled (a prefix-cache hit's not)
    prefix_cache_hits: int = 0  # prompts that restored a cached prefix
    prefix_cache_misses: int = 0  # prompts prefilled from scratch with the cache on
    prefix_cache_reused_tokens: int = 0  # prompt tokens restored rather than prefilled
    prefix_cache_entries: int = 0  # snapshots the cache holds now
    prefix_cache_bytes: int = 0  # what they take
    preemptions: int = 0  # rows moved out of the live batch to keep within the KV budget
    preempted: int = 0  # rows waiting to resume now (counted in `queued`)
    kv_budget_tokens: int = 0  # tokens of KV the budget holds (0: no budget)
    kv_tokens: int = 0  # tokens of KV the running rows hold now
    max_kv_tokens: int = 0  # the most a decode step has held (running rows and joiners)
    sessions_saved: int = 0  # conversations written to session files
    sessions_restored: int = 0  # prompts that continued from a session file
    session_save_failures: int = 0  # finished requests whose session file could not be written
    grammars_compiled: int = 0  # constraints compiled (structured outputs; cache misses)
    grammar_compile_seconds: float = 0.0  # spent compiling them, on threads of their own
    grammar_cache_bytes: int = 0  # compiled grammars kept for reuse
    spec_verify_rows: int = 0  # rows of decode steps that verified drafts
    spec_draft_tokens: int = 0  # drafted tokens those rows fed
    spec_accepted_tokens: int = 0  # of those, the ones that stood
    spec_emitted_tokens: int = 0  # tokens those rows emitted: accepted drafts and one more each
    # tokens a row's grammar forced (a tool call's markup, a schema's keys: jump-forward) that
    # a step fed beside the row's own token, rather than a step each
    jump_forward_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafted tokens that stood, of those verified (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_row_step(self) -> float:
        """Tokens a row emits per verify step, on average (1 would be no gain)."""
        return self.spec_emitted_tokens / self.spec_verify_rows if self.spec_verify_rows else 0.0


@dataclass(frozen=True)
class StepProfile:
    """Where a served step's time went over a window of `seconds` (Engine.profile): the
    worker's time inside tensor operations by class (profiled), the rest of its busy time
    (Python: dispatch, sampling code, KV bookkeeping), the time it waited for the event loop,
    and the event loop thread's own CPU time (scheduling, routers, detokenizing, streams),
    which runs beside the worker's. `timing`: the engine's counters over the window (forward,
    prefill, rebatch, sampling seconds)."""

    seconds: float
    decode_steps: int
    decoded_rows: int
    worker_busy: float
    op_seconds: dict[str, float]
    op_calls: int
    event_loop_cpu: float
    timing: dict[str, float]

    def per_step_ms(self) -> dict[str, float]:
        """The window's figures in milliseconds per decode step."""
        steps = max(1, self.decode_steps)
        ops = sum(self.op_seconds.values())
        parts = {
            **self.op_seconds,
            "worker python": max(0.0, self.worker_busy - ops),
            "worker idle": max(0.0, self.seconds - self.worker_busy),
        }
        out = {k: 1000 * v / steps for k, v in parts.items()}
        out["step"] = 1000 * self.seconds / steps
        out["event loop cpu"] = 1000 * self.event_loop_cpu / steps
        for kind in ("prefill", "rebatch", "sampling"):
            out[kind] = 1000 * self.timing.get(kind, 0.0) / steps
        return out
