"""The decoding modes by the name requests use (`decoding`): the built-in ones register
themselves when `engine.decoding.dlm_modes` is imported, a new one when its file is."""

from __future__ import annotations

from cdlm_serve.engine.decoding.dlm_modes.base import DecodingMode

MODES: dict[str, DecodingMode] = {}


def register(mode: DecodingMode) -> DecodingMode:
    """Add a mode under its name (a second mode of one name is a mistake, refused)."""
    if mode.name in MODES and type(MODES[mode.name]) is not type(mode):
        raise ValueError(f"a decoding mode named {mode.name!r} is already registered")
    MODES[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    MODES.pop(name, None)
