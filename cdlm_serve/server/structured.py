"""Structured outputs as a request spells them, read into the one grammar its answer must follow
(`engine.decoding.grammar.GrammarSpec`): OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and
vLLM's newer `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`),
so that clients written for either work unchanged. At most one may be set."""

from __future__ import annotations

import json
from typing import Any

from cdlm_serve.engine.decoding import GrammarSpec
from cdlm_serve.server.errors import APIError
from cdlm_serve.server.schemas import GenerationRequest


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _schema(value: Any, param: str) -> GrammarSpec:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "the JSON schema is not valid JSON") from None
    if not isinstance(value, dict):
        raise _bad(param, "the JSON schema must be an object")
    return GrammarSpec("json_schema", json.dumps(value, sort_keys=True), param)


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    param = "response_format"
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad(param, "json_schema needs its schema ({'name': ..., 'schema': {...}})")
        return _schema(spec["schema"], param)
    raise _bad(param, "type must be one of text, json_object, json_schema")


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    return value


def _choices(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _bad(param, "must be a non-empty list of strings")
    return GrammarSpec("choice", json.dumps(value), param)


def _structured_outputs(value: dict[str, Any]) -> GrammarSpec | None:
    param = "structured_outputs"
    found: list[GrammarSpec] = []
    if value.get("json") is not None:
        found.append(_schema(value["json"], param))
    if value.get("regex") is not None:
        found.append(GrammarSpec("regex", _text(value["regex"], param), param))
    if value.get("choice") is not None:
        found.append(_choices(value["choice"], param))
    if value.get("grammar") is not None:
        found.append(GrammarSpec("grammar", _text(value["grammar"], param), param))
    if value.get("json_object"):
        found.append(GrammarSpec("json_object", param=param))
    if len(found) > 1:
        raise _bad(param, "set one of json, regex, choice, grammar, json_object")
    return found[0] if found else None


def grammar_of(req: GenerationRequest) -> GrammarSpec | None:
    """The grammar a completions or chat body asks its answers to follow, or None; a 400 that
    names the field for one that is malformed, or for two at once."""
    found: list[GrammarSpec] = []
    if req.response_format is not None and (rf := _response_format(req.response_format)):
        found.append(rf)
    if req.guided_json is not None:
        found.append(_schema(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(GrammarSpec("regex", _text(req.guided_regex, "guided_regex"), "guided_regex"))
    if req.guided_choice is not None:
        found.append(_choices(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        text = _text(req.guided_grammar, "guided_grammar")
        found.append(GrammarSpec("grammar", text, "guided_grammar"))
    if req.structured_outputs is not None and (so := _structured_outputs(req.structured_outputs)):
        found.append(so)
    if len(found) > 1:
        names = ", ".join(g.param for g in found)
        message = f"set one structured output, not several ({names})"
        raise APIError(400, message, param=found[1].param)
    return found[0] if found else None
