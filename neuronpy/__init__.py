"""neuronpy: lockstep gang-batched LLM serving in plain PyTorch."""

from neuronpy.engine.engine import Engine, EngineConfig
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
