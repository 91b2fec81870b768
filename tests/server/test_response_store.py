"""Stored responses: the SQLite store alone (owners, conversations, eviction, reopening), and a
real server behind two API keys that is killed with SIGKILL and started again on the same file."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from server.responses.store import ResponseStore, owner_of
from tests.servers import running_server

ALICE, BOB = owner_of("key-a"), owner_of("key-b")


def _response(response_id: str, previous: str | None = None, text: str = "hi") -> dict:
    return {"id": response_id, "previous_response_id": previous, "output": [
        {"id": f"msg_{response_id}", "type": "message", "role": "assistant",
         "status": "completed", "content": [{"type": "output_text", "text": text}]}]}


def _user(text: str) -> list[dict]:
    return [{"id": f"msg_in_{text}", "type": "message", "role": "user", "content": text}]


def test_a_response_is_its_owners_alone_and_conversations_follow_the_chain(tmp_path):
    async def run():
        store = ResponseStore(tmp_path / "r.db", 10**6)
        await store.put(ALICE, _response("r1"), _user("one"))
        await store.put(ALICE, _response("r2", "r1"), _user("two"))
        assert (await store.get(ALICE, "r1"))["id"] == "r1"
        assert await store.get(BOB, "r1") is None  # the control is the line above
        history = await store.history(ALICE, "r2")
        assert [item["id"] for item in history] == ["msg_in_one", "msg_r1", "msg_in_two",
                                                    "msg_r2"]
        assert await store.history(BOB, "r2") is None
        assert not await store.delete(BOB, "r1")
        assert await store.delete(ALICE, "r1")
        assert await store.history(ALICE, "r2") is None  # a link of the chain is gone
        store.close()
        reopened = ResponseStore(tmp_path / "r.db", 10**6)
        assert (await reopened.input_items(ALICE, "r2")) == _user("two")
        reopened.close()

    asyncio.run(run())


def test_the_oldest_responses_go_first_past_the_size_limit():
    async def run():
        store = ResponseStore(":memory:", 1500)
        for index in range(10):
            await store.put(ALICE, _response(f"r{index}", text="x" * 100), _user(str(index)))
        kept = [index for index in range(10) if await store.get(ALICE, f"r{index}")]
        assert kept and kept == list(range(10 - len(kept), 10)) and len(kept) < 10
        store.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("store") / "responses.db"


def _server(model_folder, store_path):
    args = ["--model", str(model_folder), "--speculative-method", "none",
            "--served-model-name", "tiny", "--response-store", str(store_path)]
    return running_server(args, "tiny", env={"SPECSERVE_API_KEY": "key-a,key-b"})


def _client(server, key):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_stored_responses_survive_kill_9_and_stay_with_their_key(tiny_chat_model_folder,
                                                                 store_path):
    with _server(tiny_chat_model_folder, store_path) as server:
        alice, bob = _client(server, "key-a"), _client(server, "key-b")
        first = alice.responses.create(model="tiny", input="Hello there", max_output_tokens=4,
                                       temperature=0)
        assert alice.responses.retrieve(first.id).id == first.id  # the control: 200 for its key
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="tiny", input="more", previous_response_id=first.id,
                                 max_output_tokens=2)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
    with _server(tiny_chat_model_folder, store_path) as server:
        alice, bob = _client(server, "key-a"), _client(server, "key-b")
        assert alice.responses.retrieve(first.id).model_dump() == first.model_dump()
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        second = alice.responses.create(model="tiny", input="And again", max_output_tokens=4,
                                        previous_response_id=first.id, temperature=0)
        assert second.usage.input_tokens > first.usage.input_tokens
