"""The systems a benchmark runs, all on the same loaded weights, each behind `System`:
neuronpy in-process (neuronpy_engine.py) or behind its server over HTTP (neuronpy_server.py),
and its peers: transformers' `generate()` serial and static-batched (hf_generate.py) and its
continuous batching (hf_batching.py). bench/lineup.py picks and builds them.

Every system runs a `Workload` and returns what its clients saw, as `RequestRecord`s with
times in seconds since the workload started, so one set of metric functions covers them all.
Each lives only for its own run (see bench/threads.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from neuronpy.bench.records import ProfiledSteps, RunOutput
from neuronpy.bench.workloads import Workload

# the systems' names, in the order the table shows them
NEURONPY = "neuronpy"
NEURONPY_SERIAL = "neuronpy-serial"
NEURONPY_EAGER = "neuronpy-eager"
NEURONPY_SPEC = "neuronpy-spec"  # neuronpy with speculative decoding (bench --speculative)
# with --tensor-parallel N: the same engine on one device, beside the split one
NEURONPY_ONE_DEVICE = "neuronpy-1-device"
HF_SERIAL = "hf-generate"
HF_STATIC = "hf-static"
HF_CB = "hf-generate-batch"
PEERS = (NEURONPY_SERIAL, NEURONPY_EAGER, HF_SERIAL, HF_STATIC, HF_CB)

PEER_HELP = {
    NEURONPY_SERIAL: "neuronpy with max_in_flight=1 (one request at a time)",
    NEURONPY_EAGER: "neuronpy with its layers run eagerly (compile off)",
    HF_SERIAL: "transformers generate(), one request at a time",
    HF_STATIC: "transformers generate() over static left-padded batches (K wide in W1)",
    HF_CB: "transformers continuous batching (the manager behind model.generate_batch)",
}

WARMUP_TOKENS = 4  # output tokens of each warm-up request


class System(Protocol):
    """One system under test, started for each run (the runner does all of it in one fresh
    thread): `start` builds it and warms it up on `warmup`, `run` measures one workload,
    `profile` (after `run`) runs it once more unmeasured and says where its steps went, or
    None where it cannot say; `close` tears it down."""

    name: str
    description: str  # one line for the report
    workloads: frozenset[str]  # the workloads it can run (W5 needs constrained decoding)

    def start(self, warmup: Workload) -> None: ...

    def run(self, workload: Workload) -> RunOutput: ...

    def profile(self, workload: Workload) -> ProfiledSteps | None: ...

    def close(self) -> None: ...

    def info(self) -> dict[str, Any]:
        """What the results file says about it: description, drive, its settings."""
        ...
