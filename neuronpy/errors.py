"""The few exception classes neuronpy raises; the HTTP layer maps them to OpenAI error bodies."""

from __future__ import annotations


class NeuronError(Exception):
    """Base class of every error neuronpy raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # pickled whole, what the subclasses keep beside the message too (`param`,
        # `retry_after`): an engine process raises them for the server's process
        return (type(self), self.args, self.__dict__)


class InvalidRequestError(NeuronError, ValueError):
    """A request parameter is invalid (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UnsupportedArchitectureError(NeuronError):
    """The model's architecture has no native implementation in neuronpy.arch."""


class ModelLoadError(NeuronError):
    """A model or tokenizer could not be found or loaded."""


class QueueFullError(NeuronError):
    """Admission refused: max_in_flight are running and the queue is full (HTTP 503)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnhealthyError(NeuronError):
    """The engine's device worker failed; every active and later request fails fast (HTTP 503)."""


class ShuttingDownError(NeuronError):
    """Admission refused: the server is shutting down and drains what it already admitted
    (HTTP 503)."""


class WorkerError(NeuronError):
    """A job failed inside the device worker thread."""


class RequestFailedError(NeuronError):
    """One request failed on its own (its detokenizer, say); the others are unaffected."""
