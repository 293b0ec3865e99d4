"""Request and response bodies of the OpenAI-compatible API (pydantic, strict types)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from cdlm_serve.engine.compaction import (
    AUTO,
    BUDGETS,
    KEY_QUERIES,
    METHODS,
    MIN_RATIO,
    QUERY_SOURCES,
)
from cdlm_serve.engine.decoding import MODES
from cdlm_serve.engine.sessions import SESSION_ID_PATTERN
from cdlm_serve.server.request_limits import (
    MAX_CHOICES_LISTED,
    MAX_DLM_STEPS,
    MAX_LOGIT_BIAS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    SEED_MAX,
    SEED_MIN,
)

# Request bodies: strict JSON types, unknown fields ignored, no NaN or infinite numbers.
STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _registered_method(name: str) -> str:
    if name != AUTO and name not in METHODS:
        raise ValueError(f"method must be one of {', '.join((AUTO, *METHODS))}")
    return name


def _list_methods(schema: dict[str, Any]) -> None:
    """The schema lists the methods registered when it is built, where a Literal would (after
    the type), so a method registered after import is listed and served too."""
    rest = {key: schema.pop(key) for key in list(schema) if key != "type"}
    schema["enum"] = [AUTO, *METHODS]
    schema.update(rest)


# A compaction method's name: one of the registered ones (engine.compaction.METHODS), checked at
# request time.
MethodName = Annotated[
    str, AfterValidator(_registered_method), Field(json_schema_extra=_list_methods)
]


def session_id_field() -> Any:  # the one rule (engine.sessions.store), as a schema pattern
    return Field(None, pattern=f"^{SESSION_ID_PATTERN}$")


Prompt = str | list[str] | list[int] | list[list[int]]
# The request fields only diffusion models take.
DLM_OPTIONS = ("decoding", "block_size", "threshold", "steps", "alg", "alg_temp", "remasking")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What completions and chat completions share: the model, sampling, stopping, streaming
    and our extensions. Unknown fields are ignored, as OpenAI-compatible servers do; known
    fields must have the right JSON type (a string is not a number)."""

    model_config = STRICT

    model: str
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Token id (as a string, OpenAI's form) -> a bias added to its logit.
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions (the OpenAI SDK sends them through `extra_body`).
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # Structured outputs (server/structured.py): OpenAI's response_format, and vLLM's
    # spellings, its older guided_* fields and its structured_outputs object.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES_LISTED)
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extension: keep generating past end-of-text (benchmarks need fixed-length answers).
    ignore_eos: bool = False
    # vLLM's: prefix-cache blocks are reused only by requests with the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Extensions for diffusion models (the OpenAI SDK sends them through `extra_body`).
    # One of the registered decoding modes (engine.decoding.dlm_modes.MODES), read at request time
    # so a mode registered after import is served too; the schema lists them when it is built.
    decoding: str | None = Field(
        None, json_schema_extra=lambda schema: schema.update(enum=[*MODES, None])
    )
    block_size: int | None = Field(None, ge=1, le=1024)
    threshold: float | None = Field(None, ge=0.0)
    # The reference releases' own options: a fixed number of denoising steps (Dream's and
    # LLaDA's `steps`), Dream's `alg` / `alg_temp` and LLaDA's `remasking`.
    steps: int | None = Field(None, ge=1, le=MAX_DLM_STEPS)
    alg: Literal["maskgit_plus", "topk_margin", "entropy", "origin"] | None = None
    alg_temp: float | None = Field(None, ge=0.0, le=100.0)
    remasking: Literal["low_confidence", "random"] | None = None

    def dlm_options_set(self) -> list[str]:
        """The diffusion-only options this request sets (an AR model refuses them)."""
        return list(self.model_dump(include=set(DLM_OPTIONS), exclude_none=True))

    @field_validator("decoding")
    @classmethod
    def _registered_mode(cls, v: str | None) -> str | None:
        if v is not None and v not in MODES:
            raise ValueError(f"decoding must be one of {', '.join(MODES)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in v.items():
            if not token.isdigit() or len(token) > 12:
                raise ValueError(f"logit_bias keys must be token ids, not {token[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], not {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return stops


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # Extensions for sessions: continue from a session's KV cache, and append this prompt and
    # its completion to it (unless append is false).
    session_id: str | None = session_id_field()
    append: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and (len(v) == 0 or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str = Field(max_length=64)
    arguments: str  # a JSON object's text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call an assistant's earlier message made (sent back with the conversation)."""

    model_config = STRICT
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=256)  # the call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates (and `server.tool_format.render`) take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions (text only)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Function tools (server/tool_calls.py checks them): chat's form, {"type": "function",
    # "function": {"name", "description", "parameters"}}.
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required", or {"type": "function", "function": {"name": ...}}.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache gave instead of a prefill


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Autoregressive models (OpenAI's field; 0 with --no-prefix-caching).
    prompt_tokens_details: PromptTokensDetails | None = None
    # Diffusion models only: forward passes (denoising steps) the request took.
    steps: int | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cdlm-serve"
    max_model_len: int
    # What the model computes in and its KV caches hold ("bfloat16", "float32"): chosen by
    # --dtype, and on a CPU by its features (`auto`).
    dtype: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# The error bodies the OpenAPI schema documents for most routes (the shape of server/errors.py).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
SESSION_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    507: ERROR_RESPONSES[400],
}


class AutoCompactSpec(BaseModel):
    """A session's online compaction (`engine.compaction.auto.AutoCompact`): whenever an
    append takes its cache past `max_tokens` physical slots, the slots before the last
    `keep_recent` are compacted `ratio`x with `method`, between requests."""

    model_config = STRICT
    max_tokens: int = Field(ge=16)
    ratio: float = Field(ge=MIN_RATIO)
    method: MethodName = AUTO  # engine.compaction.options.resolve_auto
    keep_recent: int = Field(0, ge=0)
    query_source: Literal[QUERY_SOURCES] | None = None  # type: ignore[valid-type]
    quantize: Literal["int8"] | None = None
    budgets: Literal[BUDGETS] | None = None  # type: ignore[valid-type]
    key_queries: Literal[KEY_QUERIES] | None = None  # type: ignore[valid-type]


class SessionCreateRequest(BaseModel):
    model_config = STRICT
    model: str
    id: str | None = session_id_field()
    prompt: str | list[int] | None = None
    auto_compact: AutoCompactSpec | None = None


class CompactOptions(BaseModel):
    """How to compact a cache: to `target_tokens` slots, or by `ratio` (slots before / slots
    after, over the compacted region), and with what (the routes that compact share these)."""

    model_config = STRICT
    ratio: float | None = Field(None, ge=MIN_RATIO)  # smaller gains are not worth a compaction
    target_tokens: int | None = Field(None, ge=1)
    # One source of truth: the engine's own lists (typing reads a tuple as the values).
    # "auto": the measured choice (engine.compaction.options.resolve_auto).
    method: MethodName = AUTO
    # None: the method's own (engine.compaction.row.default_query_source).
    query_source: Literal[QUERY_SOURCES] | None = None  # type: ignore[valid-type]
    keep_recent: int = Field(0, ge=0)
    # "int8": the compacted segment is kept as int8 codes, on disk and in memory (kv_quant).
    quantize: Literal["int8"] | None = None
    # "attention": the KV heads' slots by measured attention; "measured": by the model's
    # shipped schedule, 400 where it has none; "global": by the method's key scores over every
    # head (engine.compaction.budgets). None: "global" for "auto", else "uniform".
    budgets: Literal[BUDGETS] | None = None  # type: ignore[valid-type]
    # Whose attention ranks the am-highest variants' keys: "context" (the context's own
    # queries, their default) or "reference" (those they are fitted on); None: the method's
    # own (engine.compaction.row.default_key_queries).
    key_queries: Literal[KEY_QUERIES] | None = None  # type: ignore[valid-type]


class CompactRequest(CompactOptions):
    """POST /v1/sessions/{id}/compact."""
