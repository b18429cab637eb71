"""Errors are always vLLM's OpenAI-style JSON with a 4xx for bad input: never a plain-text 500, never a cut
stream (security audit: a short salted prompt used to crash the engine's extra-keys slicing)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvroute.sim.tokenizer import VOCAB_SIZE
from kvroute.sim.worker import SimWorker

from tests.sim.conftest import words

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def assert_openai_error(r: httpx.Response) -> None:
    """vLLM's error body: JSON ``{"error": {message, type, param, code}}`` with the status as code."""
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    error = orjson.loads(r.content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code
    assert isinstance(error["message"], str) and error["message"] and error["type"]


def assert_well_formed(r: httpx.Response) -> None:
    """A 4xx is an OpenAI error object; a 200 is a whole answer or a whole stream ending in [DONE]."""
    assert r.status_code < 500, r.text[:300]
    if r.status_code != 200:
        assert_openai_error(r)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = _events(r.text)
        assert events and events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), r.text[-300:]
    else:
        body = r.json()
        assert "error" not in body and (len(body["choices"]) == 1 if "choices" in body else "tokens" in body)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_short_salted_prompt_is_served(make_fleet: Any, client: Any, path: str, stream: bool) -> None:
    """The audit's case: a prompt shorter than one block, with a salt, streaming or not."""
    fleet = await make_fleet(1)
    worker = fleet[0]
    body: dict[str, Any] = {"cache_salt": "x", "stream": stream}
    body.update({"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]})
    r = await client.post(f"{worker.url}{path}", json=body)
    assert r.status_code == 200
    assert_well_formed(r)
    assert worker.engine.running == 0


async def test_salt_reaches_the_first_block_completed_by_the_answer(make_fleet: Any, client: Any) -> None:
    """No full prompt block, but the answer completes block 0: it carries the salt, as vLLM places it."""
    fleet = await make_fleet(1)
    worker = fleet[0]
    r = await client.post(f"{worker.url}{COMPLETIONS}", json={"prompt": "hi", "cache_salt": "x", "max_tokens": 20})
    assert r.status_code == 200
    assert [block.extra for block in worker.engine.cache.gpu.values()] == [["x"]]
    salted = await client.post(f"{worker.url}{COMPLETIONS}", json={"prompt": words(40), "cache_salt": "x"})
    plain = await client.post(f"{worker.url}{COMPLETIONS}", json={"prompt": words(40)})
    assert salted.status_code == plain.status_code == 200
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # other tenant, other keys


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/no/such/route", 404), ("GET", COMPLETIONS, 405), ("POST", "/v1/models", 405), ("GET", "/sim/x", 404)],
)
async def test_routing_errors_are_json(make_fleet: Any, client: Any, method: str, path: str, status: int) -> None:
    fleet = await make_fleet(1)
    r = await client.request(method, f"{fleet[0].url}{path}")
    assert r.status_code == status
    assert_well_formed(r)


async def test_unhealthy_answers_are_json(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    await client.post(f"{url}/sim/health", json={"healthy": False})
    for r in (await client.get(f"{url}/health"), await client.post(f"{url}{COMPLETIONS}", json={"prompt": "a"})):
        assert r.status_code == 503
        assert_openai_error(r)


async def test_a_fault_inside_the_engine_is_a_json_500_or_an_in_band_stream_error(
    make_fleet: Any, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: should the engine ever fail, the client still gets vLLM's error shape."""
    fleet = await make_fleet(1)
    worker = fleet[0]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(worker.engine.cache, "store", broken)
    r = await client.post(f"{worker.url}{COMPLETIONS}", json={"prompt": words(40)})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "InternalServerError" and "injected" in r.json()["error"]["message"]
    r = await client.post(f"{worker.url}{CHAT}", json={"messages": [{"role": "user", "content": "a"}], "stream": True})
    assert r.status_code == 200  # the stream had started: in-band error, then [DONE], never a cut transfer
    events = _events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
    assert worker.engine.running == 0  # slot and blocks given back
    monkeypatch.undo()
    assert (await client.post(f"{worker.url}{COMPLETIONS}", json={"prompt": words(40)})).status_code == 200


# -- property: no generated body yields a 5xx or a plain-text error -------------------------------------


@pytest.fixture
async def one_worker(make_fleet: Any) -> SimWorker:
    fleet = await make_fleet(1)
    worker: SimWorker = fleet[0]
    return worker


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=6),
    st.just([]),
    st.just({}),
)
PIECES = st.sampled_from(["a", "hi", "w1", "<|user|>", "<|end|>", "é", "日本", "\n", "\t", "  ", "x" * 30])
WORDS = st.lists(PIECES, max_size=60).map(" ".join)
TEXT = st.one_of(WORDS, st.text(max_size=40))
TOKENS = st.lists(st.integers(256, 5000), max_size=100)
ODD_TOKENS = st.lists(st.one_of(st.integers(-3, VOCAB_SIZE + 3), st.booleans()), max_size=20)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), st.text(max_size=5), JUNK)
ROLES = st.sampled_from(["user", "system", "assistant", "tool"])
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": ROLES, "content": st.one_of(WORDS, st.lists(PART, max_size=3))}),
    min_size=1,
    max_size=3,
)
ODD_MESSAGES = st.one_of(
    st.lists(
        st.one_of(st.fixed_dictionaries({"role": st.one_of(st.just(""), JUNK), "content": TEXT}), JUNK), max_size=3
    ),
    st.lists(st.fixed_dictionaries({"role": ROLES, "content": JUNK}), min_size=1, max_size=2),
    JUNK,
)
#: Anything a client could put in a field: the valid kinds of every field, and junk.
ANY_VALUE = st.one_of(
    TEXT,
    TOKENS,
    ODD_TOKENS,
    st.lists(TEXT, min_size=1, max_size=2),
    st.lists(TOKENS, min_size=1, max_size=2),
    MESSAGES,
    ODD_MESSAGES,
    st.integers(-2, 1100),
    st.integers(8000, 9000),
    st.fixed_dictionaries({"include_usage": st.booleans()}),
    JUNK,
)
FIELDS = st.sampled_from(
    [
        "prompt",
        "messages",
        "cache_salt",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "add_generation_prompt",
        "n",
        "model",
        "kv_transfer_params",
    ]
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request of a random shape (text or token prompt, messages, salt, max_tokens, stream), then
    up to three fields overwritten with anything: most examples get deep into the engine, some are junk."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT, "/tokenize"]))
    body: dict[str, Any] = {}
    if path == CHAT or (path == "/tokenize" and draw(st.booleans())):
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(st.one_of(WORDS, TOKENS) if path == COMPLETIONS else WORDS)
    body["stream"] = draw(st.booleans())
    optional = {
        "cache_salt": st.text(min_size=1, max_size=8),
        "max_tokens": st.integers(1, 60),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    }
    body.update(draw(st.fixed_dictionaries({}, optional=optional)))
    body.update(draw(st.dictionaries(FIELDS, ANY_VALUE, max_size=3)))
    return path, body


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=requests())
async def test_no_generated_body_yields_a_5xx_or_plain_text(
    one_worker: SimWorker, client: Any, call: tuple[str, dict[str, Any]]
) -> None:
    worker = one_worker  # one worker for all examples: function-scoped fixtures are set up once per test
    path, body = call
    r = await client.post(
        f"{worker.url}{path}", content=orjson.dumps(body), headers={"content-type": "application/json"}
    )
    event(f"{path} {r.status_code} {'stream' if body.get('stream') is True else 'plain'}")
    assert_well_formed(r)
    assert worker.engine.running == 0 and worker.engine.waiting == 0  # nothing leaked or stuck
