"""Request bodies of the Responses API (`server/routes/responses.py`): OpenAI's fields, checked
strictly; those this server does not support are accepted in their neutral values only
(`ResponseCreateRequest.unsupported`), so a client learns of a 400 instead of a silent
difference."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from cdlm_serve.engine.compaction import AUTO
from cdlm_serve.engine.sessions import SESSION_ID_PATTERN
from cdlm_serve.server.request_limits import SEED_MAX, SEED_MIN
from cdlm_serve.server.schemas import STRICT, AutoCompactSpec, CompactOptions, MethodName

# OpenAI's bounds on `metadata`.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def response_id_field() -> Any:  # a response is a session: the session ids' rule
    return Field(None, pattern=f"^{SESSION_ID_PATTERN}$")


class ResponseCreateRequest(BaseModel):
    """POST /v1/responses."""

    model_config = STRICT

    model: str
    input: str | list[Any] | None = None  # items checked by server.response_input
    instructions: str | None = None
    previous_response_id: str | None = response_id_field()
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Function tools (server/tool_calls.py checks them): {"type": "function", "name",
    # "description", "parameters"}; tool_choice "none", "auto", "required" or
    # {"type": "function", "name": ...}.
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted in their neutral values only (`unsupported`).
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt: dict[str, Any] | None = None
    # Extensions, as on the other routes.
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # A new conversation's online compaction (`POST /v1/sessions`' field); its continuations
    # keep it.
    auto_compact: AutoCompactSpec | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (
            len(v) > METADATA_KEYS
            or any(len(k) > METADATA_KEY_CHARS for k in v)
            or any(len(s) > METADATA_VALUE_CHARS for s in v.values())
        ):
            raise ValueError(
                f"metadata holds at most {METADATA_KEYS} pairs, keys of at most "
                f"{METADATA_KEY_CHARS} and values of at most {METADATA_VALUE_CHARS} characters"
            )
        return v

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` in chat's `response_format` shape (a JSON schema's fields sit beside
        its type here, inside `json_schema` there), or None for plain text."""
        fmt = (self.text or {}).get("format")
        if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
            return None
        if fmt.get("type") == "json_schema":
            inner = {k: v for k, v in fmt.items() if k != "type"}
            return {"type": "json_schema", "json_schema": inner}
        return dict(fmt)

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do (text in, text and
        function calls out, nothing in the background), or None."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        used = {
            "text": not isinstance(fmt, dict)
            or fmt.get("type") not in ("text", "json_object", "json_schema"),
            "reasoning": any(v is not None for v in (self.reasoning or {}).values()),
            "background": bool(self.background),
            "conversation": self.conversation is not None,
            "include": bool(self.include),
            "truncation": self.truncation == "auto",
            "top_logprobs": bool(self.top_logprobs),
            "prompt": self.prompt is not None,
        }
        return next((name for name, on in used.items() if on), None)


class ResponseCompactRequest(CompactOptions):
    """POST /v1/responses/compact: a stored response's cache compacted into a new stored
    response (or, without `previous_response_id`, the `input` conversation
    prefilled, then compacted). The compaction options are extensions here (the SDK sends them
    through `extra_body`); neither ratio nor target_tokens: `ratio` 2; `method` "auto" by
    default, as every compaction (engine.compaction.options.resolve_auto)."""

    model: str
    previous_response_id: str | None = response_id_field()
    input: str | list[Any] | None = None
    instructions: str | None = None
    method: MethodName = AUTO
