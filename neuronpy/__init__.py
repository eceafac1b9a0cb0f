"""neuronpy: lockstep gang-batched LLM serving in plain PyTorch."""

from typing import TYPE_CHECKING, Any

from neuronpy.config import EngineConfig
from neuronpy.engine.types import (
    FinishReason,
    GenerationEvent,
    OutputFormat,
    SamplingParams,
    TokenLogprob,
    ToolCall,
)
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    NeuronError,
    QueueFullError,
    UnsupportedArchitectureError,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineUnhealthyError",
    "FinishReason",
    "GenerationEvent",
    "InvalidRequestError",
    "NeuronError",
    "OutputFormat",
    "QueueFullError",
    "SamplingParams",
    "TokenLogprob",
    "ToolCall",
    "UnsupportedArchitectureError",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from neuronpy.engine.engine import Engine


def __getattr__(name: str) -> Any:
    # Engine (and torch with it) is imported on first use: reading a config file needs neither
    if name == "Engine":
        from neuronpy.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'neuronpy' has no attribute {name!r}")
