"""DeviceWorker: one thread that owns the model and every tensor, answering jobs through futures."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from neuronpy.arch.attention import PrefillChunk
from neuronpy.arch.kv import BatchRow, KvBatch, KvSnapshot, KvSource, States, assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.mixer import STATE_BLOCK
from neuronpy.arch.vision import VisionTower
from neuronpy.defaults import DEFAULT_PREFILL_CHUNK
from neuronpy.errors import WorkerError
from neuronpy.media import Media, split_media_id
from neuronpy.threads import start_in_own_thread
from neuronpy.worker.drafting import DraftBatch
from neuronpy.worker.jobs import (
    AssembleKvBatch,
    AssembleResult,
    CacheKvSnapshots,
    CacheResult,
    DraftTokens,
    DropCachedKv,
    DropKvSnapshot,
    DropResult,
    EmbedBatch,
    EmbedResult,
    ExtractKvRows,
    ExtractResult,
    ForwardLogitsBatch,
    ForwardResult,
    Job,
    LoadKvSnapshot,
    LoadResult,
    OffloadKv,
    OffloadResult,
    Prefill,
    PrefillResult,
    ProfileResult,
    ReleaseDraftKv,
    SaveKvSnapshot,
    SaveResult,
    Shutdown,
    StartProfile,
    StopProfile,
    WorkerStats,
    WorkerStatsResult,
)
from neuronpy.worker.session_files import SESSION_ERRORS, read_session, write_session

log = logging.getLogger(__name__)

# images whose vision-tower rows the worker keeps (a few MB each at most)
MEDIA_CACHE = 32


class MediaRows:
    """One image's rows as the vision tower gives them, tile by tile: the tiles a prefill
    chunk's tokens fall in are encoded when it runs (and kept), so that a large image's
    encoding is spread over its prompt's chunks, between the batch's decode steps."""

    def __init__(self, media: Media, vision: VisionTower, model: LlamaModel) -> None:
        self.media = media
        self.vision = vision
        self.tiles = vision.tiles(media.inputs)
        if self.tiles < 1 or media.tokens % self.tiles:
            raise WorkerError(f"an image of {media.tokens} tokens in {self.tiles} tiles")
        self.per_tile = media.tokens // self.tiles
        hidden = model.config.hidden_size
        self.rows = torch.zeros(media.tokens, hidden, dtype=model.dtype, device=model.device)
        self.done = [False] * self.tiles

    def covering(self, lo: int, hi: int) -> torch.Tensor:
        """All its rows [tokens, hidden], those of tokens [lo, hi) encoded."""
        first, last = lo // self.per_tile, (hi - 1) // self.per_tile
        todo = [k for k in range(first, last + 1) if not self.done[k]]
        if todo:
            span = range(todo[0], todo[-1] + 1)
            tiled = None if self.tiles == 1 else span
            out = self.vision.encode(self.media.inputs, tiled)
            want = len(span) * self.per_tile
            if out.shape[0] != want:
                raise WorkerError(
                    f"the vision tower gave {out.shape[0]} rows for {want} tokens of an image"
                )
            self.rows[span.start * self.per_tile : span.stop * self.per_tile] = out
            for k in span:
                self.done[k] = True
        return self.rows


class DeviceWorker:
    """Runs jobs one at a time on its own thread; tensors never leave it but as CPU logits."""

    # with no job for this many seconds, the loop calls on_idle (None: never)
    idle_seconds: float | None = None
    # whether snapshots can be saved to and read from session files (each holds every KV head)
    supports_sessions = True

    def __init__(
        self,
        model: LlamaModel,
        name: str = "model",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        draft_model: LlamaModel | None = None,
        vision: VisionTower | None = None,
    ) -> None:
        """`draft_model`: a smaller model of the same tokenizer, drafting for speculative
        decoding (DraftTokens) in a lockstep batch of its own on this thread. `vision`: a
        vision-language model's image encoder, for the prompts that hold images."""
        self.model = model
        self.vision = vision
        # each image's rows, by image number, the most recently used last (MEDIA_CACHE kept)
        self._media: OrderedDict[int, MediaRows] = OrderedDict()
        if model.has_states:  # a mixer's chunks are cut at STATE_BLOCK multiples: so are these
            prefill_chunk = -(-prefill_chunk // STATE_BLOCK) * STATE_BLOCK
        self.prefill_chunk = prefill_chunk
        self.drafts = DraftBatch(draft_model, prefill_chunk) if draft_model is not None else None
        # a snapshot, or a row of the last live batch not copied out yet (see BatchRow)
        self._snapshots: dict[int, KvSource] = {}
        # the prefix cache's snapshots: read-only (a prefill copies them); a prompt's entry
        # shares its sequence's columns (see _prefilled). Which to keep and which to evict is
        # the engine's decision (see engine/prefix_cache.py)
        self._cache: dict[int, KvSnapshot] = {}
        self._batch: KvBatch | None = None
        self._jobs: queue.SimpleQueue[tuple[Job, Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._loop, name=f"neuronpy-worker-{name}", daemon=True
        )
        self._closed = False
        # why the worker can run no more jobs (a subclass sets it: a lost peer process)
        self.broken: str | None = None
        self._profile = OpProfile()

    def start(self) -> DeviceWorker:
        self._thread.start()
        return self

    def submit(self, job: Job) -> Future[Any]:
        """Queues a job; the future resolves with its result or the error it raised."""
        fut: Future[Any] = Future()
        if self._closed:
            fut.set_exception(WorkerError("the device worker has shut down"))
            return fut
        if isinstance(job, Shutdown):
            self._closed = True
        self._jobs.put((job, fut))
        return fut

    def shutdown(self, timeout: float | None = None) -> None:
        if not self._closed:
            self.submit(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                job, fut = self._jobs.get(timeout=self.idle_seconds)
            except queue.Empty:
                self.on_idle()
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            began = self._profile.job_began = time.perf_counter()
            try:
                with torch.inference_mode():
                    result = self.handle(job)
            except BaseException as exc:  # answered to the caller, who decides what is fatal
                log.exception("worker job %s failed", type(job).__name__)
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            finally:
                self._profile.busy += time.perf_counter() - began
            if isinstance(job, Shutdown):
                self._snapshots.clear()
                self._cache.clear()
                self._batch = None
                self.drafts = None
                return

    def on_idle(self) -> None:
        """Called on the worker thread after `idle_seconds` without a job (a subclass may
        check on its peers)."""

    def handle(self, job: Job) -> Any:
        """Executes one job on the calling thread (the worker thread, or a test)."""
        match job:
            case Prefill():
                return self._prefill(job)
            case AssembleKvBatch():
                return self._assemble(job)
            case ForwardLogitsBatch():
                return self._forward(job)
            case ExtractKvRows():
                return self._extract(job)
            case DraftTokens():
                if self.drafts is None:
                    raise WorkerError("this model has no draft model")
                return self.drafts.draft(job)
            case ReleaseDraftKv():
                if self.drafts is not None:
                    self.drafts.release(job.keys)
                return None
            case DropKvSnapshot():
                dropped = sum(self._snapshots.pop(i, None) is not None for i in job.snapshot_ids)
                return DropResult(dropped)
            case CacheKvSnapshots():
                return self._cache_snapshots(job)
            case DropCachedKv():
                return DropResult(sum(self._cache.pop(i, None) is not None for i in job.cache_ids))
            case OffloadKv():
                return self._offload(job)
            case SaveKvSnapshot():
                return self._save(job)
            case LoadKvSnapshot():
                return self._load(job)
            case EmbedBatch() if job.score_ids is not None:
                return EmbedResult(self.model.pair_logits(job.sequences, job.score_ids).to("cpu"))
            case EmbedBatch():
                vectors = self.model.pooled(job.sequences, job.pooling, job.normalize)
                return EmbedResult(vectors.to("cpu"))
            case WorkerStats():
                return WorkerStatsResult(
                    snapshots=len(self._snapshots),
                    snapshot_bytes=sum(s.nbytes for s in self._snapshots.values()),
                    live_batch_size=self._batch.batch_size if self._batch else 0,
                    live_kv_columns=self._batch.kv_columns if self._batch else 0,
                    cached_snapshots=len(self._cache),
                    cached_bytes=sum(s.nbytes for s in self._cache.values()),
                )
            case StartProfile():
                return self._profile.start()
            case StopProfile():
                return self._profile.stop()
            case Shutdown():
                return None
        raise TypeError(f"unknown job {job!r}")

    def _snapshot(self, snapshot_id: int) -> KvSnapshot:
        """A stored snapshot, given storage of its own if it is still a row of a batch."""
        source = self._snapshots[snapshot_id]
        if isinstance(source, BatchRow):
            source = self._snapshots[snapshot_id] = source.materialize()
        return source

    def _require(self, snapshot_ids: tuple[int, ...]) -> None:
        missing = [i for i in snapshot_ids if i not in self._snapshots]
        if missing:
            raise WorkerError(f"unknown snapshots {missing}")

    def _materialize_rows(self) -> None:
        """Copies out the rows no batch took, so the retired batch's buffers can go."""
        for sid, source in self._snapshots.items():
            if isinstance(source, BatchRow):
                self._snapshots[sid] = source.materialize()

    def _prefill(self, job: Prefill) -> PrefillResult:
        parent, extend = self._prefill_parent(job)
        snapshot, hidden = self.model.prefill(
            job.token_ids,
            parent,
            self.prefill_chunk,
            reserve=job.reserve,
            extend=extend,
            capture=self._capture(job, parent),
            media=self._media_rows(job),
        )
        return self._prefilled(job, snapshot, hidden[-1])

    def _media_rows(self, job: Prefill) -> dict[int, torch.Tensor] | None:
        """The rows of the images whose media ids the job's tokens hold, by image number: the
        tiles that hold the job's tokens encoded by the vision tower (once: an image's rows
        are kept while MEDIA_CACHE more recent images are not, for its prompt's later
        chunks, a preempted request's second prefill, another request of the same image)."""
        wanted: dict[int, list[int]] = {}
        for t in job.token_ids:
            if t < 0:
                number, j = split_media_id(t)
                wanted.setdefault(number, []).append(j)
        if not wanted:
            return None
        if self.vision is None:
            raise WorkerError("this model reads no images")
        given = {m.number: m for m in job.media}
        rows = {}
        for number, places in wanted.items():
            entry = self._media.get(number)
            if entry is None:
                media = given.get(number)
                if media is None:
                    raise WorkerError("a prefill names an image it does not carry")
                entry = self._media[number] = MediaRows(media, self.vision, self.model)
                while len(self._media) > MEDIA_CACHE:
                    self._media.popitem(last=False)
            self._media.move_to_end(number)
            rows[number] = entry.covering(min(places), max(places) + 1)
        return rows

    def _capture(self, job: Prefill, parent: KvSnapshot | None) -> int | None:
        """Where a prefill keeps its fixed-size states for the prefix cache: the last
        STATE_BLOCK boundary of the finished prompt (a state cannot be cut shorter later)."""
        if job.cache_id is None or not self.model.has_states:
            return None
        total = (parent.length if parent is not None else 0) + len(job.token_ids)
        return total // STATE_BLOCK * STATE_BLOCK or None

    def _prefill_parent(self, job: Prefill) -> tuple[KvSnapshot | None, bool]:
        """The snapshot a prefill continues (None: from the start), and whether it may be grown
        in place; refuses ids that are taken."""
        extend = job.parent_id == job.snapshot_id
        if job.snapshot_id in self._snapshots and not extend:
            raise WorkerError(f"snapshot {job.snapshot_id} already exists")
        for sid in (job.cache_id, *job.clone_ids):
            if sid is not None and (sid in self._snapshots or sid in self._cache):
                raise WorkerError(f"snapshot {sid} already exists")
        parent: KvSnapshot | None = None
        if job.parent_id is not None:
            if job.parent_id in self._cache:  # copied by prefill: the cached one is never changed
                parent, extend = self._cache[job.parent_id], False
            else:
                parent = self._snapshot(job.parent_id)
            if job.parent_length is not None and job.parent_length != parent.length:
                parent = _prefix_of(parent, job.parent_length)
                extend = False
        return parent, extend

    def _prefilled(self, job: Prefill, snapshot: KvSnapshot, last: torch.Tensor) -> PrefillResult:
        """Stores a prefill's snapshot (and its prefix-cache entry and clones); answers the
        logits of its last token `last` ([hidden], final-normed), if it asked."""
        self._snapshots[job.snapshot_id] = snapshot
        cached_bytes = cached_length = 0
        if job.cache_id is not None and self.model.has_states:
            # the prompt's KV up to the boundary its states were kept at (views: written once)
            if snapshot.checkpoint is not None:
                at, states = snapshot.checkpoint
                cached = self._cache[job.cache_id] = _prefix_of(snapshot, at, states)
                cached_bytes, cached_length = cached.nbytes, at
        elif job.cache_id is not None:
            # the same columns, not a copy: a sequence's KV columns are written once, and its
            # decode steps write past them (in place, when it enters the batch without a
            # copy); the entry pins the buffers, and counts them (KvSnapshot.nbytes)
            cached = self._cache[job.cache_id] = KvSnapshot(
                snapshot.keys, snapshot.values, list(snapshot.token_ids), snapshot.buffers
            )
            cached_bytes, cached_length = cached.nbytes, cached.length
        snapshot.checkpoint = None
        for sid in job.clone_ids:
            self._snapshots[sid] = _compact(snapshot)
        cached = {"cached_bytes": cached_bytes, "cached_length": cached_length}
        if not job.logits:
            return PrefillResult(job.snapshot_id, snapshot.length, None, **cached)
        logits = self.model.logits(last).to("cpu")
        # (a tensor-parallel follower's head computes no logits: it answers no argmax either)
        argmax = int(torch.argmax(logits)) if job.argmax and logits.numel() else None
        return PrefillResult(job.snapshot_id, snapshot.length, logits, argmax, **cached)

    def _cache_snapshots(self, job: CacheKvSnapshots) -> CacheResult:
        self._require(job.snapshot_ids)
        nbytes, lengths = [], []
        for sid, columns in zip(job.snapshot_ids, job.keep, strict=True):
            source = self._snapshots.pop(sid)
            if columns < source.length:
                whole = source.materialize() if isinstance(source, BatchRow) else source
                source = _prefix_of(whole, columns)
            # a row of the last batch is copied out once, compact, as materialize does
            cached = source.materialize() if isinstance(source, BatchRow) else _compact(source)
            self._cache[sid] = cached
            nbytes.append(cached.nbytes)
            lengths.append(cached.length)
        return CacheResult(tuple(nbytes), tuple(lengths))

    def _offload(self, job: OffloadKv) -> OffloadResult:
        self._require(job.snapshot_ids)
        nbytes = 0
        for sid in job.snapshot_ids:
            snapshot = self._snapshot(sid)  # a row of the batch gets storage of its own
            if snapshot.keys[0].device.type != "cpu":
                snapshot = self._snapshots[sid] = _compact(snapshot, torch.device("cpu"))
            nbytes += snapshot.nbytes
        return OffloadResult(nbytes)

    def _save(self, job: SaveKvSnapshot) -> SaveResult:
        self._require((job.snapshot_id,))
        snapshot = self._snapshot(job.snapshot_id)
        if job.drop:
            del self._snapshots[job.snapshot_id]
        cpu = torch.device("cpu")
        # copied here (the writer thread runs no tensor operation); a snapshot on the CPU is
        # never written again once it has left the batch, so its own storage is kept as it is
        keys = [k.to(cpu).contiguous() for k in snapshot.keys]
        values = [v.to(cpu).contiguous() for v in snapshot.values]
        # (copies: the states of a snapshot still in a batch's storage are advanced in place)
        states = [tuple(t.to(cpu, copy=True).contiguous() for t in st) for st in snapshot.states]
        tokens = list(snapshot.token_ids)
        written, _ = start_in_own_thread(
            lambda: write_session(job.path, keys, values, tokens, job.metadata, states),
            "neuronpy-session-write",
        )
        return SaveResult(len(tokens), written)

    def _load(self, job: LoadKvSnapshot) -> LoadResult:
        if job.cache_id in self._cache or job.cache_id in self._snapshots:
            raise WorkerError(f"snapshot {job.cache_id} already exists")
        c = self.model.config
        try:
            keys, values, tokens, states = read_session(
                job.path,
                self.model.device,
                fingerprint=job.fingerprint,
                dtype=self.model.dtype,
                layers=self.model.num_kv_layers,
                kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                value_dim=c.cached_value_dim,
                states=self.model.state_layout(),
            )
        except SESSION_ERRORS as exc:  # (their messages never name the path; nor does this)
            if isinstance(exc, FileNotFoundError):
                # deleted since its request was admitted: nothing to restore; the engine then
                # prefills the whole prompt, as for a new session (its common prefix with () is 0)
                return LoadResult((), 0)
            raise WorkerError(f"{job.path.name} cannot be restored: {exc}") from exc
        snapshot = self._cache[job.cache_id] = KvSnapshot(keys, values, tokens, states=states)
        return LoadResult(tuple(tokens), snapshot.nbytes)

    def _assemble(self, job: AssembleKvBatch) -> AssembleResult:
        self._require(job.snapshot_ids)
        for i in job.snapshot_ids:  # preempted sequences offloaded to CPU memory come back
            source = self._snapshots[i]
            if isinstance(source, KvSnapshot) and source.keys[0].device != self.model.device:
                self._snapshots[i] = _compact(source, self.model.device)
        self._batch = assemble_batch([self._snapshots[i] for i in job.snapshot_ids])
        for i in job.snapshot_ids:
            kept = self._snapshots.pop(i)
            if job.keep_snapshots and isinstance(kept, KvSnapshot):
                # the batch may decode into its spare columns: it keeps them to itself
                self._snapshots[i] = KvSnapshot(
                    kept.keys, kept.values, kept.token_ids, states=kept.states
                )
        self._materialize_rows()
        return AssembleResult(
            self._batch.batch_size, self._batch.padded_len, self._batch.padding_columns
        )

    def _forward(self, job: ForwardLogitsBatch) -> ForwardResult:
        if self._batch is None:
            raise WorkerError("no live batch to step")
        if job.trim:
            self._batch.trim(job.trim)
        if len({p.snapshot_id for p in job.prefills}) != len(job.prefills):
            raise WorkerError("the prefill chunks of one step must fill different snapshots")
        dev = self.model.device
        counts = None
        if job.drafts:
            if len(job.drafts) != len(job.token_ids):
                raise WorkerError("a verify step needs one draft tuple per row")
            fed = [
                t for token, d in zip(job.token_ids, job.drafts, strict=True) for t in (token, *d)
            ]
            counts = [1 + len(d) for d in job.drafts]
            tokens = torch.tensor(fed, dtype=torch.long, device=dev)
        else:
            tokens = torch.tensor(job.token_ids, dtype=torch.long, device=dev)[:, None]
        prefilled: tuple[PrefillResult, ...] = ()
        if not job.prefills and counts is None:
            hidden = self.model.forward_batch_decode(self._batch, tokens)
        else:
            chunks = []
            for p in job.prefills:
                parent, extend = self._prefill_parent(p)
                capture = self._capture(p, parent)
                media = self._media_rows(p)
                chunks.append(PrefillChunk(p.token_ids, parent, p.reserve, extend, capture, media))
            out = self.model.forward_step(self._batch, tokens, chunks, counts=counts)
            hidden = out.hidden
            prefilled = tuple(
                self._prefilled(p, snapshot, last)
                for p, snapshot, last in zip(
                    job.prefills, out.snapshots, out.chunk_hidden, strict=True
                )
            )
        logits = self.model.logits(hidden).to("cpu")
        argmax = tuple(logits.argmax(dim=-1).tolist()) if job.argmax and logits.numel() else ()
        return ForwardResult(logits, prefilled, argmax)

    def _extract(self, job: ExtractKvRows) -> ExtractResult:
        if len(job.rows) != len(job.snapshot_ids):
            raise WorkerError("ExtractKvRows needs one snapshot id per row")
        if job.rows and self._batch is None:
            raise WorkerError("no live batch to extract from")
        if job.trim and self._batch is not None:
            self._batch.trim(job.trim)
        if len(set(job.rows)) != len(job.rows) or any(
            not 0 <= row < self._batch.batch_size  # type: ignore[union-attr]
            for row in job.rows
        ):
            raise WorkerError(f"bad rows {job.rows} to extract")
        lengths = []
        for row, sid in zip(job.rows, job.snapshot_ids, strict=True):
            # left in place: the next batch keeps or copies it (see BatchRow)
            source = self._batch.row(row)  # type: ignore[union-attr]
            self._snapshots[sid] = source
            lengths.append(source.length)
        self._batch = None
        return ExtractResult(tuple(lengths))


class OpProfile:
    """torch.profiler on the worker thread (its recording is per thread), between a
    StartProfile and a StopProfile job; operations summed by class. The window runs from the
    end of the start job to the beginning of the stop job: the profiler's own set-up and
    summing are not in it."""

    def __init__(self) -> None:
        self._profiler: torch.profiler.profile | None = None
        self._started = self._busy_at_start = 0.0
        self.busy = 0.0  # seconds the worker thread has spent running jobs, ever
        self.job_began = 0.0  # when the job running now began

    def start(self) -> None:
        if self._profiler is not None:
            raise WorkerError("a profile is already recording")
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.__enter__()
        self._started = time.perf_counter()
        # (this job's own time, up to now, is not the window's)
        self._busy_at_start = self.busy + (self._started - self.job_began)

    def stop(self) -> ProfileResult:
        if self._profiler is None:
            raise WorkerError("no profile is recording")
        now = time.perf_counter()
        seconds = now - self._started
        busy = self.busy + (now - self.job_began) - self._busy_at_start
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        by_class = {"linear": 0.0, "attention": 0.0, "other ops": 0.0}
        events = profiler.events()
        for event in events:
            by_class[op_class(event.name, _ancestors(event))] += event.self_cpu_time_total / 1e6
        return ProfileResult(seconds, max(0.0, busy), by_class, len(events))


def _ancestors(event: Any) -> list[str]:
    """The names of the ranges a profiled operation ran within, innermost first."""
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def op_class(name: str, within: Sequence[str] = ()) -> str:
    """linear (matrix products against weights), attention, or other ops (elementwise,
    norms, copies, indexing), by a profiled operation's name, or the ranges it ran within
    (arch/exact.py's attention is products and elementwise ops in an "attention" range)."""
    if any("scaled_dot_product" in n or "attention" in n for n in (name, *within)):
        return "attention"
    op = name.rsplit("::", 1)[-1]
    if "linear" in op or op in ("addmm", "mm", "matmul", "bmm"):
        return "linear"
    return "other ops"


def _prefix_of(snapshot: KvSnapshot, length: int, states: list[States] | None = None) -> KvSnapshot:
    """Views of a snapshot's first `length` tokens (no copy), with the fixed-size `states`
    after them when the model has any: a snapshot's own are after its last token, so a
    shorter prefix needs states taken there (a prefill's checkpoint)."""
    if not 0 < length <= snapshot.length:
        raise WorkerError(f"a prefix of {length} tokens of a snapshot of {snapshot.length}")
    if states is None:
        if snapshot.states and length != snapshot.length:
            raise WorkerError(
                f"a prefix of {length} tokens of a snapshot of {snapshot.length} with fixed-size "
                "states (they hold after its last token only)"
            )
        states = snapshot.states
    return KvSnapshot(
        keys=[k[:, :, :length] for k in snapshot.keys],
        values=[v[:, :, :length] for v in snapshot.values],
        token_ids=list(snapshot.token_ids[:length]),
        states=states,
    )


def _compact(snapshot: KvSnapshot, device: torch.device | None = None) -> KvSnapshot:
    """A copy holding just the snapshot's columns (no spare room, no shared storage), on
    `device` if given (into CPU memory: pinned when a GPU is there, for faster copies back)."""
    pin = device is not None and device.type == "cpu" and torch.cuda.is_available()

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device or t.device, memory_format=torch.contiguous_format, copy=True)
        return t.pin_memory() if pin else t

    return KvSnapshot(
        keys=[copy(k) for k in snapshot.keys],
        values=[copy(v) for v in snapshot.values],
        token_ids=list(snapshot.token_ids),
        states=[tuple(copy(t) for t in st) for st in snapshot.states],
    )
