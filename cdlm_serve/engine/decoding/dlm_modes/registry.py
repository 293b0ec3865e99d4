"""The decoding modes by the name requests use (`decoding`): the built-in ones register
themselves when `engine.decoding.dlm_modes` is imported, a new one when its file is."""

from __future__ import annotations

from cdlm_serve.engine.decoding.dlm_modes.base import DecodingMode
from cdlm_serve.engine.registry import Registry

_MODES = Registry[DecodingMode]("decoding mode")
MODES = _MODES.items
register = _MODES.register
unregister = _MODES.unregister
