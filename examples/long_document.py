"""Keep a long document as a session, compact its KV cache, and ask questions about it.

A session holds a model's KV cache between requests. This example

1. creates a session whose prompt is a long document (read from `--file`, or built here: a few
   paragraphs with one fact hidden in the middle) and prints its size,
2. compacts its cache `--ratio`-fold (`--method`, by default the server's own, `auto`: KVzip's
   keys shared over every head, docs/compaction.md) and prints the size after and the time,
3. asks questions that continue from the compacted cache (`session_id` with `append: false`,
   so every question sees the document alone and the session stays as it was),
4. deletes the session.

Run it against the default server (SmolLM2-135M-Instruct):

    cdlm-serve
    python examples/long_document.py
    python examples/long_document.py --file notes.txt --question "Who wrote it?" --ratio 20

The sessions API (`/v1/sessions`) is the server's own, so it is called with httpx; the
questions are ordinary completions through the OpenAI SDK, the session named in `extra_body`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

# The built document: paragraphs of prose, cycled to the length asked for, with FACT inserted
# into the middle one (the default question asks for it).
FACT = "The code name of the blue box in the harbour master's office is Orchid-417."
PARAGRAPHS = (
    "Every morning the fishing boats of Kelmouth left the harbour before dawn, their lamps "
    "swaying over the black water, and came back at noon with crates of mackerel and cod.",
    "The lighthouse on the northern cliff was kept by Ada Pryce, who had climbed its hundred "
    "and twelve steps twice a day for thirty years and logged every ship she saw pass.",
    "On market days the square filled with stalls of bread, wool and salted fish, and the "
    "church bell rang at nine so that nobody could say they had not heard the prices called.",
    "In winter the storms came from the west. The sea wall was raised twice in living memory, "
    "and the older houses along the quay still had their doors a full step above the street.",
    "The school by the chapel taught forty children in two rooms. Its teacher, Mr Lowe, kept "
    "a barometer in the hall and let the children read it aloud before the first lesson.",
    "The railway reached the town in the spring of 1894, and with it came visitors from the "
    "cities who walked the cliffs, painted the harbour and complained about the wind.",
)
QUESTIONS = (
    "What is the code name of the blue box?",
    "Who keeps the lighthouse?",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CDLM_SERVE_API_KEY", "unused"),
        help="the server's --api-key, if it has one (default: $CDLM_SERVE_API_KEY)",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--file", type=Path, help="the document (default: one built here)")
    parser.add_argument(
        "--paragraphs",
        type=int,
        default=24,
        help="paragraphs of the built document (default: 24, about 1K tokens)",
    )
    parser.add_argument("--ratio", type=float, default=10.0, help="compaction ratio (>= 1.5)")
    parser.add_argument(
        "--method",
        default="auto",
        help="compaction method: auto (the server's default), Attention Matching's "
        "am-highest-fast, am-highest, am-omp-fast, am-omp, or a baseline (snapkv, h2o, "
        "streaming, expected_attention, kvzip, random)",
    )
    parser.add_argument(
        "--keep-recent",
        type=int,
        default=32,
        help="the document's last tokens, kept as they are (default: 32)",
    )
    parser.add_argument(
        "--question",
        action="append",
        help="a question about the document (repeatable; default: two about the built one)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    return parser.parse_args(argv)


def build_document(paragraphs: int) -> str:
    """`paragraphs` paragraphs of prose (at least one), FACT at the end of the middle one."""
    chosen = [PARAGRAPHS[i % len(PARAGRAPHS)] for i in range(max(1, paragraphs))]
    middle = len(chosen) // 2
    chosen[middle] = f"{chosen[middle]} {FACT}"
    return "\n\n".join(chosen) + "\n"


def describe(info: dict[str, Any]) -> str:
    """A session's size, as GET /v1/sessions/{id} reports it."""
    return (
        f"{info['tokens']:,} tokens, logical length {info['logical_length']:,}; "
        f"cache {info['physical_tokens']:,} physical tokens, {info['bytes']:,} bytes"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.file is not None:
        document = args.file.read_text()
        questions = args.question or ["What is this document about?"]
        print(f"document: {args.file} ({len(document):,} characters)")
    else:
        document = build_document(args.paragraphs)
        questions = args.question or list(QUESTIONS)
        print(f"document: built here, {len(document):,} characters, the fact in its middle")

    headers = {"Authorization": f"Bearer {args.api_key}"}
    api = httpx.Client(base_url=args.base_url, headers=headers, timeout=600)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    # The server prefills the document's KV cache now, before it answers.
    started = time.perf_counter()
    created = api.post("/sessions", json={"model": args.model, "prompt": document})
    created.raise_for_status()
    sid = created.json()["id"]
    try:
        print(f"session {sid} created in {time.perf_counter() - started:.2f} s")
        before = api.get(f"/sessions/{sid}").json()
        print(f"before compaction: {describe(before)}")

        print(
            f"compacting {args.ratio:g}x with {args.method} "
            f"(the last {args.keep_recent} tokens kept as they are)..."
        )
        started = time.perf_counter()
        r = api.post(
            f"/sessions/{sid}/compact",
            json={"ratio": args.ratio, "method": args.method, "keep_recent": args.keep_recent},
        )
        if r.status_code != 200:
            print(f"error: compaction failed: {r.status_code} {r.text}", file=sys.stderr)
            return 1
        report = r.json()
        elapsed = time.perf_counter() - started
        after = report["session"]
        print(f"after compaction: {describe(after)}")
        print(
            f"compaction took {elapsed:.2f} s ({report['seconds']['total']:.2f} s on the "
            f"server): {report['tokens_before']:,} -> {report['tokens_after']:,} slots, "
            f"{before['bytes'] / max(1, after['bytes']):.1f}x fewer bytes"
        )

        for question in questions:
            answer = client.completions.create(
                model=args.model,
                prompt=f"\nQuestion: {question}\nAnswer:",
                max_tokens=args.max_tokens,
                temperature=0,
                stop=["\n"],  # one line of answer
                # continue from the session's cache; append=False leaves the session as it was
                extra_body={"session_id": sid, "append": False},
            )
            print(f"Q: {question}")
            print(f"A: {answer.choices[0].text.strip()}")

        final = api.get(f"/sessions/{sid}").json()
        print(f"after the questions: {describe(final)}")
    finally:
        api.delete(f"/sessions/{sid}").raise_for_status()
        print(f"session {sid} deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
