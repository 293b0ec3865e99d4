"""The diffusion engine's decoding modes, by the name requests use (`decoding`)."""

from engine.dlm_modes.base import DecodingMode
from engine.dlm_modes.cdlm import Cdlm
from engine.dlm_modes.fast_dllm import FastDllm
from engine.dlm_modes.vanilla import Vanilla

MODES: dict[str, DecodingMode] = {m.name: m for m in (Cdlm(), FastDllm(), Vanilla())}

__all__ = ["MODES", "DecodingMode"]
