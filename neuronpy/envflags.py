"""Switches read from the environment: on/off flags (NEURON_BATCHING, NEURON_ONEDNN), and
whether to write colours (NO_COLOR, a terminal or not)."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF_VALUES = ("0", "false", "off", "no")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """False when the variable says 0, false, off or no (any case); true otherwise or unset."""
    env = os.environ if environ is None else environ
    return env.get(name, "1").strip().lower() not in OFF_VALUES


def colour(stream: object, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to write ANSI colours to `stream`: only to a terminal, and not when NO_COLOR is
    set to anything but "" (no-color.org)."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR", ""):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # closed, or detached
        return False
