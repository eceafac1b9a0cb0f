"""On/off switches read from the environment (NEURON_BATCHING, NEURON_ONEDNN)."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF_VALUES = ("0", "false", "off", "no")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """False when the variable says 0, false, off or no (any case); true otherwise or unset."""
    env = os.environ if environ is None else environ
    return env.get(name, "1").strip().lower() not in OFF_VALUES
