"""Decoding: the engines that turn prompts into tokens, one step at a time.

What the server and the served model use is exported here: the two engines (`AREngine`,
`DLMEngine`) and their contract (`Engine`, `EngineOutput`), what a request asks of them
(`GenerationOptions`, from which each engine makes its own parameters: `SamplingParams`,
`DLMParams`), the diffusion decoding modes' registry (`MODES`), and the queue of model work
between the steps (`WorkQueue`, `Work`, `Priority`). Inside: `request`,
`scheduler` (rows, admission, aborts), `work_queue`, `model_runner` (one forward for a step's rows),
`sampling`, `unmasking`, `text_output`, `prefix_cache`, `dlm_sequence`, `dlm_modes/`.
"""

from cdlm_serve.engine.decoding.ar_engine import AREngine, ARSequence
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine
from cdlm_serve.engine.decoding.dlm_modes import MODES
from cdlm_serve.engine.decoding.dlm_sequence import DLMParams, DLMSequence
from cdlm_serve.engine.decoding.grammar import JSON_OPTIONS, GrammarError, GrammarSpec
from cdlm_serve.engine.decoding.interface import Engine, EngineOutput, TokenLogprob
from cdlm_serve.engine.decoding.model_runner import FUSED_PREFILL_TOKENS, ModelRunner
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
from cdlm_serve.engine.decoding.request import (
    AUTOREGRESSIVE_OPTIONS,
    DIFFUSION_OPTIONS,
    GenerationOptions,
)
from cdlm_serve.engine.decoding.sampling import GenerationParams, SamplingParams, eos_token_ids
from cdlm_serve.engine.decoding.unmasking import DREAM_ALGS, LLADA_REMASKING
from cdlm_serve.engine.decoding.work_queue import Priority, Work, WorkQueue

__all__ = [
    "AUTOREGRESSIVE_OPTIONS",
    "DIFFUSION_OPTIONS",
    "DREAM_ALGS",
    "FUSED_PREFILL_TOKENS",
    "JSON_OPTIONS",
    "LLADA_REMASKING",
    "MODES",
    "AREngine",
    "ARSequence",
    "DLMEngine",
    "DLMParams",
    "DLMSequence",
    "Engine",
    "EngineOutput",
    "GenerationOptions",
    "GenerationParams",
    "GrammarError",
    "GrammarSpec",
    "ModelRunner",
    "PrefixCache",
    "Priority",
    "SamplingParams",
    "TokenLogprob",
    "Work",
    "WorkQueue",
    "eos_token_ids",
]
