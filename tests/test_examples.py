"""The scripts in examples/, run as a user runs them, against one real server of tiny models
(an autoregressive llama, `tiny`, and a LLaDA-format diffusion model, `dlm`). Tiny models
answer gibberish: what is checked is the structure and the numbers the scripts print, against
what the server says itself."""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys

import httpx
import pytest

import tiny_models
from conftest import REPO, running_server


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    llada = tmp_path_factory.mktemp("llada")
    tiny_models.llada_tiny(llada)
    with running_server(
        "--model",
        f"tiny={tiny_llama_dir}",
        "--model",
        f"dlm={llada}",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ) as url:
        yield url


def run_example(base: str, script: str, *args: str) -> str:
    """Run examples/`script` against the server; its stdout (it must exit 0)."""
    proc = subprocess.run(
        [sys.executable, f"examples/{script}", "--base-url", f"{base}/v1", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def no_sessions_left(base: str) -> bool:
    return httpx.get(f"{base}/v1/sessions").json()["data"] == []


def test_diffusion_stream_prints_blocks_and_steps(base):
    prompt, options = "12+34=", {"max_tokens": 24, "block_size": 8, "threshold": 0.05}
    out = run_example(
        base,
        "diffusion_stream.py",
        "--model",
        "dlm",
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
        "--block-size",
        "8",
        "--threshold",
        "0.05",
    )
    blocks = re.findall(r"^block (\d+): ('.*'|\".*\") \(\+[\d.]+ s\)$", out, re.M)
    assert len(blocks) >= 2, out
    assert [int(n) for n, _ in blocks] == list(range(1, len(blocks) + 1))
    texts = [ast.literal_eval(text) for _, text in blocks]
    answer = ast.literal_eval(re.search(r"^answer: (.*)$", out, re.M).group(1))
    assert answer == "".join(texts)
    usage = re.search(r"^usage: (\d+) tokens in (\d+) steps \((\d+) blocks\)$", out, re.M)
    assert usage is not None, out
    tokens, steps, nblocks = map(int, usage.groups())
    assert nblocks == len(blocks) and steps >= nblocks
    # The same request, not streamed (greedy: the same answer), as the server reports it.
    full = httpx.post(
        f"{base}/v1/completions", json={"model": "dlm", "prompt": prompt, **options}, timeout=120
    ).json()
    assert full["choices"][0]["text"] == answer
    assert (full["usage"]["steps"], full["usage"]["completion_tokens"]) == (steps, tokens)


SIZE = (
    r"(\d[\d,]*) tokens, logical length (\d[\d,]*); "
    r"cache (\d[\d,]*) physical tokens, (\d[\d,]*) bytes"
)


def _size(out: str, label: str) -> tuple[int, ...]:
    """(tokens, logical length, physical tokens, bytes) of the line `label: ...`."""
    found = re.search(rf"^{label}: {SIZE}$", out, re.M)
    assert found is not None, f"no {label!r} line in:\n{out}"
    return tuple(int(n.replace(",", "")) for n in found.groups())


def test_long_document_is_compacted_and_questioned(base):
    keep, ratio = 16, 4
    out = run_example(
        base,
        "long_document.py",
        "--model",
        "tiny",
        "--paragraphs",
        "1",
        "--ratio",
        str(ratio),
        "--keep-recent",
        str(keep),
        "--max-tokens",
        "8",
    )
    tokens, logical, physical, nbytes = _size(out, "before compaction")
    assert tokens == logical == physical > 100  # the byte tokenizer: a token per byte
    tokens2, logical2, physical2, nbytes2 = _size(out, "after compaction")
    assert (tokens2, logical2) == (tokens, logical)
    # The default method (auto) shares the slots over the heads unevenly: the row is as long
    # as its longest head, at least the ratio's share; the bytes at rest are the ratio's.
    assert math.ceil((physical - keep) / ratio) + keep <= physical2 < physical
    assert nbytes2 < nbytes / 2
    took = re.search(r"^compaction took ([\d.]+) s \(([\d.]+) s on the server\)", out, re.M)
    assert took is not None and float(took.group(1)) >= float(took.group(2)) > 0
    assert len(re.findall(r"^Q: .+$", out, re.M)) == 2
    assert len(re.findall(r"^A: ", out, re.M)) == 2
    # append=false: the questions left the compacted session as it was
    assert _size(out, "after the questions") == (tokens2, logical2, physical2, nbytes2)
    assert re.search(r"^session \S+ deleted$", out, re.M) and no_sessions_left(base)


def test_auto_compact_chat_stays_bounded(base):
    bound, turns = 160, 3
    out = run_example(
        base,
        "auto_compact_chat.py",
        "--model",
        "tiny",
        "--max-cache",
        str(bound),
        "--ratio",
        "4",
        "--keep-recent",
        "16",
        "--turns",
        str(turns),
        "--max-tokens",
        "8",
    )
    sizes = [
        tuple(map(int, m))
        for m in re.findall(
            r"^  logical length (\d+), cache (\d+) physical tokens \(bound \d+\), "
            r"compactions so far: (\d+)$",
            out,
            re.M,
        )
    ]
    assert len(sizes) == turns == len(re.findall(r"^assistant: ", out, re.M)), out
    logical = [s[0] for s in sizes]
    assert logical == sorted(set(logical))  # every turn grew the conversation
    assert all(physical <= bound for _, physical, _ in sizes), out
    last_logical, last_physical, compactions = sizes[-1]
    assert last_logical > bound and compactions >= 1 and last_physical < last_logical
    assert re.search(rf"^after {turns} turns: logical length {last_logical}, ", out, re.M)
    assert re.search(r"^session \S+ deleted$", out, re.M) and no_sessions_left(base)
