"""The HTTP routes, one router per API: `inference` (health, version, metrics, models,
completions, chat), `sessions` (/v1/sessions), `responses` (OpenAI's Responses API)."""

from fastapi import APIRouter

from cdlm_serve.server.routes import inference, responses, sessions

VERSION = inference.VERSION
# In the order the app includes them (the OpenAPI document lists their paths in that order).
ROUTERS: tuple[APIRouter, ...] = (inference.router, sessions.router, responses.router)

__all__ = ["ROUTERS", "VERSION"]
