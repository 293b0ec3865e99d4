"""Tool calls, structured outputs and the sampling options, through the OpenAI SDK.

1. The model is made to call `get_weather` (`tool_choice` names it: the server's grammar makes
   the arguments valid for the function's parameters), and the SDK parses the arguments into
   the pydantic model the tool was declared from.
2. The call's result goes back as a `tool` message, and the model answers in text.
3. The same conversation on the Responses API: the call is a `function_call` output item, its
   result a `function_call_output` input item, continued from the stored response's cache.
4. Structured answers: `response_format` a pydantic model (the SDK parses the answer, on chat
   and on Responses' `text_format`), `json_object`, and vLLM's `guided_regex` and
   `guided_choice` through `extra_body`.
5. The sampling options: presence, frequency and repetition penalties, `logit_bias`, `min_p`.

Run it against the default server (SmolLM2-135M-Instruct):

    cdlm-serve
    python examples/structured_and_tools.py
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Literal

import openai
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field


class GetWeather(BaseModel):
    """The current weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    sky: Literal["sunny", "cloudy", "rainy"]
    celsius: int = Field(ge=-40, le=50)


QUESTION = "What is the weather in Paris?"
RESULT = json.dumps({"city": "Paris", "sky": "sunny", "celsius": 17})


def chat(client: OpenAI, model: str) -> None:
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.parse(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        temperature=0,
    )
    (call,) = first.choices[0].message.tool_calls
    print(f"chat call: {call.function.name}({call.function.parsed_arguments!r})")
    print(f"chat finish_reason: {first.choices[0].finish_reason}")
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    final = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=40, temperature=0
    )
    print(f"chat answer: {final.choices[0].message.content!r}")


def responses(client: OpenAI, model: str) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": GetWeather.__doc__,
        "parameters": GetWeather.model_json_schema(),
    }
    first = client.responses.create(
        model=model, input=QUESTION, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=100, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    print(f"responses call: {call.name}({call.arguments})")
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
        tools=[tool],
        max_output_tokens=40,
        temperature=0,
    )
    print(f"responses answer: {second.output_text!r}")


def structured(client: OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "The weather in Rome, as JSON."}]
    done = client.chat.completions.parse(
        model=model, messages=ask, response_format=Forecast, max_tokens=100, temperature=0
    )
    print(f"structured: {done.choices[0].message.parsed!r}")
    parsed = client.responses.parse(
        model=model, input=ask[0]["content"], text_format=Forecast, max_output_tokens=100,
        temperature=0,
    )  # fmt: skip
    print(f"structured (responses): {parsed.output_parsed!r}")
    anything = client.chat.completions.create(
        model=model, messages=ask, response_format={"type": "json_object"}, max_tokens=60,
        temperature=0,
    )  # fmt: skip
    done_json = anything.choices[0]
    # Whole ("stop"): a JSON object; cut at max_tokens ("length"): a valid prefix of one.
    print(f"json_object ({done_json.finish_reason}): {done_json.message.content}")
    regex = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A date?"}], max_tokens=20,
        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )  # fmt: skip
    print(f"guided_regex: {regex.choices[0].message.content}")
    choice = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    print(f"guided_choice: {choice.choices[0].message.content}")


def sampling(client: OpenAI, model: str) -> None:
    done = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"0": -100},  # token 0 never drawn
        seed=1,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05},
    )
    print(f"sampling options: {done.choices[0].finish_reason} {done.usage.completion_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://localhost:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    chat(client, args.model)
    responses(client, args.model)
    structured(client, args.model)
    sampling(client, args.model)


if __name__ == "__main__":
    main()
