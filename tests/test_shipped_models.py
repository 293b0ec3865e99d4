"""The diffusion models this project trained (models/shipped/) load by name and solve held-out
problems through the real server."""

from __future__ import annotations

import httpx

from cdlm_serve.train.data import KINDS
from cdlm_serve.train.tasks import TASKS, exact_match
from conftest import running_server


def test_shipped_teacher_solves_held_out_addition_through_the_server():
    with running_server("--model", "cdlm-teacher", "--device", "cpu") as base:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["cdlm-teacher"]
        problems = TASKS["addition3"].held_out()[:8]  # never trained on
        body = {
            "model": "cdlm-teacher",
            "prompt": [ex.prompt for ex in problems],
            "max_tokens": KINDS["addition3"].answer_len,
            "decoding": "vanilla",  # its own decoding: one token per step
        }
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
        answers = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        correct = sum(exact_match(a, ex.answer) for a, ex in zip(answers, problems, strict=True))
        assert correct >= 7, list(zip(answers, [ex.answer for ex in problems], strict=True))
        # vanilla: one forward per answer token, up to the end of text
        assert out["usage"]["steps"] >= out["usage"]["completion_tokens"]


def test_shipped_student_solves_held_out_traces_in_few_steps():
    with running_server("--model", "cdlm-student", "--device", "cpu") as base:
        problems = TASKS["trace4"].held_out()[:8]
        body = {
            "model": "cdlm-student",
            "prompt": [ex.prompt for ex in problems],
            "max_tokens": KINDS["trace4"].answer_len,  # decoding defaults: cdlm, B = 8, tau 0.9
        }
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
        answers = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        correct = sum(exact_match(a, ex.answer) for a, ex in zip(answers, problems, strict=True))
        assert correct >= 6, list(zip(answers, [ex.answer for ex in problems], strict=True))
        # Several tokens per step: well under one forward per token (prefill included).
        assert out["usage"]["steps"] * 3 < out["usage"]["completion_tokens"]
