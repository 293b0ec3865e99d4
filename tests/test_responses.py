"""The Responses API over HTTP, driven by OpenAI's own SDK: a conversation continued from the
stored response's cache (its earlier turns never prefilled again), streamed, compacted and
continued, branched, deleted; `store: false` leaving nothing on disk; clear 400s for what is
not text. Real servers, the tiny model (its template: `<role>content\\n`, `<assistant>`)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from conftest import tiny_session_server, tree_snapshot

ANSWER = {"model": "tiny", "max_output_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def base(tiny_llama_dir, store):
    with tiny_session_server(tiny_llama_dir, store) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _meta(store: Path, rid: str) -> dict:
    return json.loads((store / rid / "meta.json").read_text())


def _prompt_tokens_fed(base: str) -> float:
    """What the engine has prefilled so far: the sum of its sequences' prompt lengths."""
    text = httpx.get(f"{base}/metrics").text
    name = r'^cdlm_serve:request_prompt_tokens_sum\{model_name="tiny"\} (\S+)$'
    match = re.search(name, text, re.M)
    return 0.0 if match is None else float(match.group(1))


def _whole(base: str, ids: list[int]) -> str:
    """The greedy answer to a whole conversation's token ids, prefilled from scratch."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_continued_response_answers_as_the_whole_conversation_without_prefilling_it(
    client, base, store
):
    first = client.responses.create(input="Hello there", instructions="Be brief.", **ANSWER)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.input_tokens == len(b"<system>Be brief.\n<user>Hello there\n<assistant>")
    stored = _meta(store, first.id)
    history = len(stored["tokens"])
    fed_before = _prompt_tokens_fed(base)
    second = client.responses.create(input="And again", previous_response_id=first.id, **ANSWER)
    fed = _prompt_tokens_fed(base) - fed_before
    new_turn = list(b"\n<user>And again\n<assistant>")
    # Only the new turn (after the answer's last token, never run yet) went through the model.
    assert fed == 1 + len(new_turn) < history
    assert second.usage.input_tokens_details.cached_tokens == history
    assert second.usage.input_tokens == history + fed
    assert second.previous_response_id == first.id
    # ... and it answers exactly as the whole conversation prefilled from scratch.
    whole = stored["tokens"] + [stored["next_input"], *new_turn]
    assert second.output_text == _whole(base, whole)
    # The first response is unchanged on disk and in the API (it can be continued again).
    assert _meta(store, first.id)["tokens"] == stored["tokens"]
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_stream_is_stored_before_it_says_completed(client, store):
    first = client.responses.create(input="Tell me", **ANSWER)
    events = list(
        client.responses.create(input="More", previous_response_id=first.id, stream=True, **ANSWER)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text
    assert _meta(store, final.id)["response"]["output"][0]["content"][0]["text"] == text
    assert client.responses.retrieve(final.id).output_text == text


def test_store_false_leaves_nothing_on_disk(client, base, store):
    first = client.responses.create(input="Keep this", **ANSWER)
    before = tree_snapshot(store)
    alone = client.responses.create(input="Forget this", store=False, **ANSWER)
    continued = client.responses.create(
        input="Forget that", previous_response_id=first.id, store=False, **ANSWER
    )
    assert alone.output_text and continued.output_text
    assert tree_snapshot(store) == before
    for rid in (alone.id, continued.id):
        assert httpx.get(f"{base}/v1/responses/{rid}").status_code == 404
    # The same turn stored answers the same (store changes where it goes, not what it says).
    stored = client.responses.create(input="Forget that", previous_response_id=first.id, **ANSWER)
    assert stored.output_text == continued.output_text


def test_branches_share_their_past_on_disk_and_outlive_it(client, store):
    root = client.responses.create(input="Start", **ANSWER)
    left = client.responses.create(input="Left", previous_response_id=root.id, **ANSWER)
    right = client.responses.create(input="Right", previous_response_id=root.id, **ANSWER)
    assert (
        _meta(store, left.id)["tokens"][: len(_meta(store, root.id)["tokens"])]
        == _meta(store, root.id)["tokens"]
    )
    # The root's segment files are linked, not copied, into each branch.
    (segment,) = (s["file"] for s in _meta(store, root.id)["segments"])
    inodes = {os.stat(store / rid / segment).st_ino for rid in (root.id, left.id, right.id)}
    assert len(inodes) == 1
    client.responses.delete(root.id)
    assert not (store / root.id).exists()
    again = client.responses.create(input="On", previous_response_id=left.id, **ANSWER)
    assert again.output_text
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.responses.retrieve(root.id)
    with pytest.raises(NotFoundError):
        client.responses.create(input="Gone", previous_response_id=root.id, **ANSWER)


def test_compact_then_continue_from_the_compacted_state(client, base, store):
    first = client.responses.create(input="A long story about boxes. " * 4, **ANSWER)
    physical = httpx.get(f"{base}/v1/sessions/{first.id}").json()["physical_tokens"]
    # A uniform method, so the row's size is exact (the default, auto, shares the slots
    # unevenly: its row is its longest head's; tests/test_sessions.py has it).
    compacted = client.responses.compact(
        model="tiny", previous_response_id=first.id, extra_body={"ratio": 4, "method": "am-omp"}
    )
    assert compacted.object == "response.compaction" and compacted.id != first.id
    (item,) = compacted.output
    assert item.type == "compaction" and item.encrypted_content == compacted.id
    info = httpx.get(f"{base}/v1/sessions/{compacted.id}").json()
    assert info["physical_tokens"] == -(-physical // 4) and info["compactions"]
    assert info["logical_length"] == len(_meta(store, first.id)["tokens"])
    # Continued the SDK's way (the compacted output as input) and by id: the same answer.
    by_item = client.responses.create(
        input=[*[o.model_dump() for o in compacted.output], {"role": "user", "content": "And?"}],
        **ANSWER,
    )
    by_id = client.responses.create(input="And?", previous_response_id=compacted.id, **ANSWER)
    assert by_item.previous_response_id == compacted.id
    assert by_item.output_text == by_id.output_text
    assert by_item.usage.input_tokens_details.cached_tokens == info["logical_length"]
    # The uncompacted response is still there, whole.
    assert httpx.get(f"{base}/v1/sessions/{first.id}").json()["physical_tokens"] == physical


def test_a_conversation_given_as_input_is_compacted_into_a_response(client, base):
    conversation = [
        {"role": "user", "content": "Where is the key? " * 3},
        {"role": "assistant", "content": "Under the mat. " * 3},
    ]
    compacted = client.responses.compact(
        model="tiny", input=conversation, extra_body={"target_tokens": 20, "method": "am-omp"}
    )
    info = httpx.get(f"{base}/v1/sessions/{compacted.id}").json()
    prompt = "<user>" + conversation[0]["content"] + "\n<assistant>" + conversation[1]["content"]
    assert info["logical_length"] == len(prompt.encode()) and info["physical_tokens"] == 20
    assert compacted.usage.input_tokens == len(prompt.encode())
    nxt = client.responses.create(input="Sure?", previous_response_id=compacted.id, **ANSWER)
    assert nxt.usage.input_tokens == len(prompt.encode()) + len(b"\n<user>Sure?\n<assistant>")


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
            400,
            "tools",
        ),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "input",
        ),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input"),
        ({"input": [{"role": "narrator", "content": "x"}]}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": "x", "previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
        ({"input": "x", "previous_response_id": "../etc"}, 400, None),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, None),
        ({"input": "x", "max_output_tokens": 100000}, 400, None),
    ],
)
def test_what_is_not_text_or_not_there_answers_a_clear_error(base, store, body, status, param):
    before = tree_snapshot(store)
    r = httpx.post(f"{base}/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    assert tree_snapshot(store) == before  # a refused request stores nothing


def test_a_plain_session_is_not_a_response(base):
    r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "plain", "prompt": "hi"})
    assert r.status_code == 201
    for req in (
        httpx.get(f"{base}/v1/responses/plain"),
        httpx.post(
            f"{base}/v1/responses",
            json={"model": "tiny", "input": "x", "previous_response_id": "plain"},
        ),
    ):
        assert req.status_code == 404 and req.json()["error"]["code"] == "response_not_found"


def test_a_refused_continuation_leaves_no_response_behind(client, base, store):
    first = client.responses.create(input="Base", **ANSWER)
    before = tree_snapshot(store)
    r = httpx.post(
        f"{base}/v1/responses",
        json={**ANSWER, "input": "x", "previous_response_id": first.id, "max_output_tokens": 10**6},
    )
    assert r.status_code == 400, r.text
    assert tree_snapshot(store) == before
    ids = {s["id"] for s in httpx.get(f"{base}/v1/sessions").json()["data"]}
    assert ids == {p.name for p in store.iterdir() if not p.name.startswith(".")}
    # The fork that was refused handed the cache back to nobody: the first still continues.
    assert client.responses.create(input="y", previous_response_id=first.id, **ANSWER).output_text


def test_a_stored_response_expires_after_its_ttl_and_a_plain_session_stays(
    tiny_llama_dir, tmp_path
):
    """--responses-ttl-hours: a response past it answers 404 (retrieve, previous_response_id)
    and is gone from disk, asked for or not (the sweep, every half TTL); one continued from it
    before it expired outlives it; a plain session is kept."""
    from openai import NotFoundError, OpenAI

    ttl = 6.0
    flag = ("--responses-ttl-hours", str(ttl / 3600))
    with tiny_session_server(tiny_llama_dir, tmp_path, *flag) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        started = time.time()
        first = client.responses.create(input="Remember", **ANSWER)
        unasked = client.responses.create(input="Never asked again", **ANSWER)
        r = httpx.post(f"{url}/v1/sessions", json={"model": "tiny", "id": "plain", "prompt": "hi"})
        assert r.status_code == 201
        assert client.responses.retrieve(first.id).output_text == first.output_text
        time.sleep(started + ttl / 2 - time.time())
        later = client.responses.create(input="Then", previous_response_id=first.id, **ANSWER)
        assert time.time() - started < ttl * 0.6  # (else the checks below race the TTL)
        time.sleep(started + ttl + 0.5 - time.time())  # first is past its TTL, later is not
        with pytest.raises(NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(NotFoundError):
            client.responses.create(input="Again", previous_response_id=first.id, **ANSWER)
        assert not (tmp_path / first.id).exists()
        assert client.responses.retrieve(later.id).output_text == later.output_text
        deadline = time.time() + ttl + 30  # the sweep runs every ttl / 2
        while (tmp_path / unasked.id).exists() and time.time() < deadline:
            time.sleep(0.2)
        assert not (tmp_path / unasked.id).exists()
        assert httpx.get(f"{url}/v1/sessions/plain").status_code == 200


def test_an_expired_response_still_in_use_is_removed_once_free(tiny_llama_dir, tmp_path):
    """A response that expires while a request holds it (one continuing it since before it
    expired) is not removed under that request: a removal waits `LOCK_WAIT` for it and then
    leaves it (on disk, in the table) for later, while every ask answers 404; once it is
    free, the next sweep removes it."""
    import asyncio

    from openai import NotFoundError, OpenAI

    from cdlm_serve.server import response_retention
    from conftest import tiny_app_server

    ttl = 3600.0  # the sweep runs every 60 s: never within this test, which calls it itself
    with tiny_app_server(tiny_llama_dir, tmp_path, responses_ttl=ttl) as (url, state):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first = client.responses.create(input="Remember", **ANSWER)
        session = state.sessions.get(first.id)
        assert session is not None and (tmp_path / first.id).is_dir()
        session.created -= 2 * ttl  # its TTL has passed
        assert session.lock.acquire(timeout=30)  # a request is using it
        try:
            with pytest.raises(NotFoundError):
                client.responses.retrieve(first.id)
            with pytest.raises(NotFoundError):
                client.responses.create(input="Again", previous_response_id=first.id, **ANSWER)
            assert asyncio.run(response_retention.sweep(state)) == 0
            # Still whole: the request holding it finishes with it.
            assert state.sessions.get(first.id) is session and not session.deleted
            assert (tmp_path / first.id / "meta.json").is_file()
        finally:
            session.lock.release()
        assert asyncio.run(response_retention.sweep(state)) == 1
        assert session.deleted and state.sessions.get(first.id) is None
        assert not (tmp_path / first.id).exists()
        with pytest.raises(NotFoundError):
            client.responses.retrieve(first.id)


def test_responses_survive_a_restart(tiny_llama_dir, tmp_path):
    from openai import OpenAI

    with tiny_session_server(tiny_llama_dir, tmp_path) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first = client.responses.create(input="Remember", **ANSWER)
        expected = client.responses.create(
            input="Now", previous_response_id=first.id, store=False, **ANSWER
        ).output_text
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        again = client.responses.create(input="Now", previous_response_id=first.id, **ANSWER)
        assert again.output_text == expected


@pytest.mark.parametrize("stopped", ["at the end of its turn", "at max_output_tokens"])
def test_a_new_turn_is_the_real_template_s_rest_of_the_conversation(smollm2_dir, stopped):
    """With SmolLM2's template (ChatML: every turn ends in <|im_end|>, the token the model
    stops at): the stored conversation, its answer's last sampled token and the new turn are
    the whole conversation's template, token for token."""
    from types import SimpleNamespace

    from cdlm_serve.engine.served_model import load_tokenizer
    from cdlm_serve.server.response_input import Turn, continuation_ids, first_prompt

    tok = load_tokenizer(smollm2_dir)
    served = SimpleNamespace(
        name="smollm2",
        chat_template=tok.chat_template,
        tokenizer=tok,
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        eos_token_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>")}),
    )
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"}]
    answer = "Paris is the capital of France."
    prompt = first_prompt(served, Turn(first[1:], "Be brief."))
    answer_ids = tok.encode(answer, add_special_tokens=False)
    if stopped == "at the end of its turn":
        cached, next_input = prompt + answer_ids, tok.convert_tokens_to_ids("<|im_end|>")
    else:
        cached, next_input = prompt + answer_ids[:-1], answer_ids[-1]
    new = [{"role": "user", "content": "And of Spain?"}]
    fed = [next_input, *continuation_ids(served, Turn(new), next_input, None, [])]
    whole = [*first, {"role": "assistant", "content": answer}, *new]
    text = tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=False)
    assert cached + fed == tok.encode(text, add_special_tokens=False)


def test_the_same_instructions_are_not_fed_again_and_new_ones_are(client, base):
    first = client.responses.create(input="Hi", instructions="Be brief.", **ANSWER)
    same = client.responses.create(
        input="Again", instructions="Be brief.", previous_response_id=first.id, **ANSWER
    )
    turn = len(b"\n<user>Again\n<assistant>")
    fed = same.usage.input_tokens - same.usage.input_tokens_details.cached_tokens
    assert fed == 1 + turn and same.instructions == "Be brief."
    # None: the conversation's instructions stay in effect (and the record says which).
    quiet = client.responses.create(input="Again", previous_response_id=same.id, **ANSWER)
    assert quiet.instructions == "Be brief."
    other = client.responses.create(
        input="Again", instructions="Be long.", previous_response_id=quiet.id, **ANSWER
    )
    fed = other.usage.input_tokens - other.usage.input_tokens_details.cached_tokens
    assert fed == 1 + len(b"\n<system>Be long.\n<user>Again\n<assistant>")


def test_disk_use_counts_the_files_a_conversation_shares_once(client, base, store):
    """Each response links its previous one's segment files: the store's disk use (its gauge
    and quota) is the bytes of the distinct files, not the sum over responses."""
    last = client.responses.create(input="One", **ANSWER)
    for word in ("Two", "Three", "Four"):
        last = client.responses.create(input=word, previous_response_id=last.id, **ANSWER)
    files: dict[int, int] = {}
    for path in store.glob("*/kv-*.safetensors"):
        files[path.stat().st_ino] = path.stat().st_size
    linked = sum(1 for path in store.glob("*/kv-*.safetensors") if path.stat().st_nlink > 1)
    assert linked >= 6  # the chain's first segments are named by several responses
    metrics = httpx.get(f"{base}/metrics").text
    (gauge,) = re.findall(r"^cdlm_serve:session_disk_bytes (\S+)$", metrics, re.M)
    assert float(gauge) == sum(files.values())


def test_a_cut_answer_s_last_token_is_kept_even_where_it_looks_like_the_turn_s_end(tmp_path):
    """The tiny template ends a turn with a newline, which is no end-of-text token: an answer
    cut at max_output_tokens on a newline keeps it, and the template's own newline follows."""
    from types import SimpleNamespace

    from cdlm_serve.server.response_input import Turn, continuation_ids
    from tiny_models import EOS_ID, byte_tokenizer

    tok = byte_tokenizer()
    served = SimpleNamespace(
        name="tiny",
        chat_template=tok.chat_template,
        tokenizer=tok,
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        eos_token_ids=frozenset({EOS_ID}),
    )
    turn = Turn([{"role": "user", "content": "Q"}])
    assert continuation_ids(served, turn, ord("\n"), None, []) == list(b"\n<user>Q\n<assistant>")


def test_a_responses_input_items_are_listed_as_the_sdk_reads_them(client, base, store):
    """`GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`): the input
    the response was created with, newest first by default, in pages; the record on disk keeps
    them, and the response object itself does not carry them."""
    first = client.responses.create(input="My name is Ada.", **ANSWER)
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "My name is Ada.")
    ]
    turn = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "And mine?"}]},
        {"role": "assistant", "content": "Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    second = client.responses.create(input=turn, previous_response_id=first.id, **ANSWER)
    newest = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in newest.data] == [
        "What is my name?", "Ada.", "And mine?", "Be brief."
    ]  # fmt: skip
    assert newest.data[1].content[0].type == "output_text" and newest.data[3].role == "developer"
    oldest = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in oldest.data] == ["Be brief.", "And mine?"]
    assert oldest.has_more and oldest.last_id == oldest.data[-1].id
    # A page that ends exactly at the last item: nothing more.
    rest = client.responses.input_items.list(second.id, order="asc", after=oldest.last_id, limit=2)
    assert [i.content[0].text for i in rest.data] == ["Ada.", "What is my name?"]
    assert not rest.has_more
    assert len(_meta(store, second.id)["response"]["input_items"]) == 4
    assert "input_items" not in httpx.get(f"{base}/v1/responses/{second.id}").json()
    for url, code in (
        (f"{base}/v1/responses/nope/input_items", 404),
        (f"{base}/v1/responses/{second.id}/input_items?after=msg_x", 404),
        (f"{base}/v1/responses/{second.id}/input_items?limit=0", 400),
        (f"{base}/v1/responses/{second.id}/input_items?order=sideways", 400),
    ):
        assert httpx.get(url).status_code == code, url


def test_has_more_says_whether_items_follow_the_page():
    """`items_page` (input_items' paging): a page that ends exactly at the last item has no
    more, one that ends a single item before it has, in either order, after an item or not."""
    from cdlm_serve.server.response_input import items_page

    items = [{"id": f"msg_{i}"} for i in range(4)]

    def page(limit: int, order: str = "asc", after: str | None = None) -> tuple[list[str], bool]:
        got = items_page(items, limit, order, after)
        return [item["id"] for item in got["data"]], got["has_more"]

    assert page(4) == (["msg_0", "msg_1", "msg_2", "msg_3"], False)
    assert page(3) == (["msg_0", "msg_1", "msg_2"], True)
    assert page(5) == (["msg_0", "msg_1", "msg_2", "msg_3"], False)
    assert page(2, after="msg_1") == (["msg_2", "msg_3"], False)
    assert page(1, after="msg_1") == (["msg_2"], True)
    assert page(2, "desc") == (["msg_3", "msg_2"], True)
    assert page(2, "desc", after="msg_2") == (["msg_1", "msg_0"], False)
    assert page(2, after="msg_3") == ([], False)
    assert items_page(items, 2, "asc", "msg_3")["first_id"] is None
