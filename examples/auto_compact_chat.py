"""A chat whose KV cache stays bounded: a session with `auto_compact`.

The session is created with an online compaction policy: whenever an appended turn takes its
cache past `--max-cache` physical tokens, the server compacts everything but the last
`--keep-recent` tokens `--ratio`-fold, by itself, between requests. Each turn is a completion
with `session_id`, which continues from the session's cache and appends the user's message and
the answer to it. After every turn this prints the answer and the session's size: its logical
length keeps growing with the conversation, its cache (physical tokens) stays under the bound.

Run it against the default server (SmolLM2-135M-Instruct):

    cdlm-serve
    python examples/auto_compact_chat.py
    python examples/auto_compact_chat.py --interactive --max-cache 512

The turns are written in the model's chat format (ChatML) as plain completions: the sessions
API continues raw token streams. The sessions API itself is called with httpx, the completions
through the OpenAI SDK (the session named in `extra_body`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
from openai import OpenAI

MESSAGES = (
    "Hi! Can you help me plan a small garden?",
    "I have a sunny patch of about four square metres.",
    "Which vegetables grow well for a beginner?",
    "How often should I water tomatoes?",
    "And what about herbs, like basil and mint?",
    "Should I keep the mint in a pot?",
    "When is the best time to plant everything?",
    "Thanks! Can you sum up the plan in three points?",
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
    parser.add_argument(
        "--max-cache",
        type=int,
        default=256,
        help="auto_compact.max_tokens: the physical tokens past which the cache is compacted "
        "(default: 256)",
    )
    parser.add_argument("--ratio", type=float, default=4.0, help="compaction ratio (>= 1.5)")
    parser.add_argument(
        "--keep-recent",
        type=int,
        default=32,
        help="the last tokens a compaction keeps as they are (default: 32)",
    )
    parser.add_argument("--method", default="auto", help="compaction method (the server's default)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument(
        "--turns",
        type=int,
        default=len(MESSAGES),
        help=f"how many of the built-in messages to send (default: all {len(MESSAGES)})",
    )
    parser.add_argument(
        "--interactive",
        action="store_true",
        help="read the user's messages from stdin (one a line; an empty line or EOF ends)",
    )
    parser.add_argument("--system", default="You are a helpful assistant.")
    return parser.parse_args(argv)


def user_messages(args: argparse.Namespace) -> Iterator[str]:
    if not args.interactive:
        yield from MESSAGES[: args.turns]
        return
    while True:
        try:
            line = input("you: ").strip()
        except EOFError:
            return
        if not line:
            return
        yield line


def turn_prompt(message: str, previous_finish: str | None) -> str:
    """The user's turn in ChatML, opening the assistant's. An answer that ended on its own
    ended with `<|im_end|>` (the model's end-of-turn token, kept in the session); one cut off
    by max_tokens did not, so it is closed here."""
    close = {None: "", "stop": "\n"}.get(previous_finish, "<|im_end|>\n")
    return f"{close}<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


def settled(api: httpx.Client, sid: str, timeout: float = 600) -> dict[str, Any]:
    """The session once the compaction its last turn may have started is done."""
    deadline = time.monotonic() + timeout
    while True:
        info: dict[str, Any] = api.get(f"/sessions/{sid}").json()
        if not info["auto_compact_pending"] or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    api = httpx.Client(base_url=args.base_url, headers=headers, timeout=600)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    policy = {
        "max_tokens": args.max_cache,
        "ratio": args.ratio,
        "method": args.method,
        "keep_recent": args.keep_recent,
    }
    system = f"<|im_start|>system\n{args.system}<|im_end|>\n"
    r = api.post("/sessions", json={"model": args.model, "prompt": system, "auto_compact": policy})
    if r.status_code != 201:
        print(f"error: the session was not created: {r.status_code} {r.text}", file=sys.stderr)
        return 1
    sid = r.json()["id"]
    print(f"session {sid}: auto_compact {policy}")
    try:
        finish: str | None = None
        turns = 0
        info: dict[str, Any] = r.json()
        for message in user_messages(args):
            turns += 1
            answer = client.completions.create(
                model=args.model,
                prompt=turn_prompt(message, finish),
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"session_id": sid},  # continue the session, append this turn
            )
            choice = answer.choices[0]
            finish = choice.finish_reason
            info = settled(api, sid)
            print(f"[turn {turns}] user: {message}")
            print(f"assistant: {choice.text.strip()}")
            print(
                f"  logical length {info['logical_length']}, cache {info['physical_tokens']} "
                f"physical tokens (bound {args.max_cache}), "
                f"compactions so far: {len(info['compactions'])}",
                flush=True,
            )
        print(
            f"after {turns} turns: logical length {info['logical_length']}, "
            f"cache {info['physical_tokens']} physical tokens, {info['bytes']:,} bytes, "
            f"compactions: {len(info['compactions'])}"
        )
    finally:
        api.delete(f"/sessions/{sid}").raise_for_status()
        print(f"session {sid} deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
