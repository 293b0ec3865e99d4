"""Stream a diffusion model's answer block by block through the official OpenAI SDK.

A diffusion model (here the shipped `cdlm-student`) writes its answer a block of tokens at a
time: every token of a block is decoded in a few parallel denoising steps, and the server
streams one chunk per completed block. The diffusion options (`decoding`, `block_size`,
`threshold`) go through the SDK's `extra_body`; with `stream_options.include_usage` the last
chunk carries the usage, including `usage.steps`, the forward passes the answer took.

Run it against the default server (which serves `cdlm-student` next to SmolLM2):

    cdlm-serve
    python examples/diffusion_stream.py
    python examples/diffusion_stream.py --prompt "512+489="

`cdlm-student` answers 3-digit additions column by column ("343+706=" ->
"3+6+0=09,4+0+0=04,3+7+0=10,=1049"); see docs/diffusion.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from openai import OpenAI
from openai.types import CompletionUsage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CDLM_SERVE_API_KEY", "unused"),
        help="the server's --api-key, if it has one (default: $CDLM_SERVE_API_KEY)",
    )
    parser.add_argument("--model", default="cdlm-student")
    parser.add_argument("--prompt", default="343+706=")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument(
        "--decoding",
        default="cdlm",
        choices=["cdlm", "fast_dllm", "vanilla"],
        help="the diffusion decoder (default: cdlm)",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (default: the model's)"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="confidence above which a token is unmasked in parallel (default: the model's)",
    )
    return parser.parse_args(argv)


def diffusion_options(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields only diffusion models take, for the SDK's `extra_body`."""
    options: dict[str, Any] = {"decoding": args.decoding}
    if args.block_size is not None:
        options["block_size"] = args.block_size
    if args.threshold is not None:
        options["threshold"] = args.threshold
    return options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    print(f"{args.model} <- {args.prompt!r} ({args.decoding} decoding)")

    started = time.perf_counter()
    stream = client.completions.create(
        model=args.model,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=diffusion_options(args),
    )
    blocks: list[str] = []
    finish_reason: str | None = None
    usage: CompletionUsage | None = None
    for chunk in stream:
        if chunk.choices:  # one chunk per completed block
            choice = chunk.choices[0]
            if choice.text:
                blocks.append(choice.text)
                elapsed = time.perf_counter() - started
                print(f"block {len(blocks)}: {choice.text!r} (+{elapsed:.2f} s)", flush=True)
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:  # the last chunk: the usage, no choices
            usage = chunk.usage

    answer = "".join(blocks)
    print(f"answer: {answer!r}")
    print(f"finish reason: {finish_reason}")
    # `steps` is the server's extension of OpenAI's usage (the SDK keeps extra fields).
    steps = getattr(usage, "steps", None)
    if usage is None or steps is None:
        print("error: the stream reported no usage steps", file=sys.stderr)
        return 1
    print(f"usage: {usage.completion_tokens} tokens in {steps} steps ({len(blocks)} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
