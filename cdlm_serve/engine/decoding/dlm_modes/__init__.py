"""The diffusion engine's decoding modes: one file each, registered by name in `MODES`."""

from cdlm_serve.engine.decoding.dlm_modes import cdlm, fast_dllm, vanilla  # noqa: F401  (they register themselves)
from cdlm_serve.engine.decoding.dlm_modes.base import DecodeContext, DecodingMode
from cdlm_serve.engine.decoding.dlm_modes.registry import MODES, register, unregister

__all__ = ["MODES", "DecodeContext", "DecodingMode", "register", "unregister"]
