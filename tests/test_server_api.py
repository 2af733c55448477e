"""The OpenAI-compatible server end to end, over real HTTP: the official `openai` client (completions and
chat, streaming and not, logprobs) against the offline `LLM.generate`, the error schema and statuses,
auth, client disconnects, and a fuzz of request bodies."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.engine.llm import LLM
from deepinfer.sampling import SamplingParams
from deepinfer.server import ServerConfig
from deepinfer.server.testing import ThreadedServer

MODEL = "deepinfer-tiny-v4"
ENGINE = dict(max_model_len=512, max_num_seqs=16, num_blocks=24)


@pytest.fixture(scope="module")
def server(tiny_v4_dir):
    with ThreadedServer(ServerConfig(model=str(tiny_v4_dir), served_model_name=MODEL, port=0, **ENGINE)) as s:
        yield s


@pytest.fixture(scope="module")
def locked(tiny_v4_dir):
    """Auth on, a tiny waiting queue and body limit: for 401, 429, 413."""
    cfg = ServerConfig(model=str(tiny_v4_dir), port=0, api_key="sekret", max_waiting=1, max_request_bytes=4000,
                       **ENGINE)
    with ThreadedServer(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_v4_dir):
    return LLM(tiny_v4_dir, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _idle(server, timeout=10.0):
    """Wait until every KV block is back (the engine finished or aborted everything)."""
    pool = server.engine.block_pool
    deadline = time.monotonic() + timeout
    while pool.num_free != pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    return pool.num_free == pool.num_blocks


def test_completion_matches_offline_greedy_with_logprobs(client, offline):
    ref = offline.generate("The capital of France", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"return_token_ids": True})
    c = r.choices[0]
    want = ref.outputs[0]
    assert c.text == want.text and c.model_extra["token_ids"] == want.token_ids
    assert c.logprobs.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)])
    assert all(len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 5


def test_completion_streaming_equals_offline(client, offline):
    ref = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_matches_offline_and_streams_the_same(client, offline):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = offline.get_tokenizer().apply_chat(messages)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == ref.text
    assert [x.logprob for x in r.choices[0].logprobs.content] == pytest.approx(
        [e[t].logprob for e, t in zip(ref.logprobs, ref.token_ids)])
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.total_tokens == len(ids) + 5


def test_chat_thinking_puts_text_in_reasoning_content(client, offline):
    messages = [{"role": "user", "content": "Why?"}]
    ids = offline.get_tokenizer().apply_chat(messages, thinking=True, reasoning_effort="max")
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    kw = {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=kw)
    reasoning, _, content = ref.text.partition("</think>")
    assert r.choices[0].message.model_extra["reasoning_content"] == reasoning
    assert r.choices[0].message.content == content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, extra_body=kw))
    assert "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks) == reasoning


def test_n_seed_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="a b c", max_tokens=3, temperature=1.0, seed=7, n=3)
    again = client.completions.create(model=MODEL, prompt="a b c", max_tokens=3, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    full = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4, temperature=0).choices[0].text
    stop = full[len(full) // 2:][:2]
    cut = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_streaming_holds_back_a_stop_string_across_tokens(client, offline):
    """The stream carries DELTA outputs: a stop string whose first characters end one token is not sent
    before the next token decides it; the chunks join to the offline text, token ids and logprobs."""
    prompt = "Once upon a time"
    free = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    pieces = [offline.get_tokenizer().decode_token(t) for t in free.token_ids]
    k = next(k for k in range(len(pieces) // 2, len(pieces) - 1) if len(pieces[k]) >= 2 and pieces[k + 1])
    stop = pieces[k][-2:] + pieces[k + 1][0]
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                  logprobs=1))[0].outputs[0]
    assert ref.finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                            logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    sent = ""
    for ch in chunks:
        sent += ch.choices[0].text
        assert ref.text.startswith(sent), "a chunk sent text the stop string cuts away"
    assert sent == ref.text and chunks[-1].choices[0].finish_reason == "stop"
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks), []) == ref.token_ids
    lps = sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), [])
    assert lps == pytest.approx([e[t].logprob for e, t in zip(ref.logprobs, ref.token_ids)])


def test_models_health_metrics_tokenize(server):
    with httpx.Client(base_url=server.url, timeout=30) as h:
        assert h.get("/health").status_code == 200
        assert h.get("/v1/models").json()["data"][0]["id"] == MODEL
        ids = h.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        assert h.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "hello world"
        assert h.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()["count"] > 0
        text = h.get("/metrics").text
    for name in ("deepinfer_num_requests_waiting", "deepinfer_num_requests_running", "deepinfer_kv_cache_usage_perc",
                 "deepinfer_time_to_first_token_seconds_bucket", "deepinfer_time_per_output_token_seconds_bucket",
                 "deepinfer_prompt_tokens_total", "deepinfer_generation_tokens_total"):
        assert name in text


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", '{"model": "nope", "prompt": "x"}', 404, "model"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": [5] * 600}), 400, "messages"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', 400,
     "max_completion_tokens"),
    ("/v1/completions", '{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}',
     400, "logprobs"),
    ("/v1/completions", '{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": 2.5}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/nothing", "{}", 404, None),
])
def test_errors_use_openai_schema(server, path, body, status, param):
    r = httpx.post(server.url + path, content=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert param is None or err["param"] == param


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_auth_queue_limit_body_limit_and_shutdown_state(locked):
    body = {"prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=locked.url, timeout=30) as h:
        assert h.post("/v1/completions", json=body).status_code == 401
        assert h.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert h.get("/v1/models").status_code == 401
        assert h.get("/health").status_code == 200  # probes stay open
        auth = {"Authorization": "Bearer sekret"}
        assert h.post("/v1/completions", json=body, headers=auth).status_code == 200
        full = h.post("/v1/completions", json={**body, "n": 2}, headers=auth)  # 2 waiting > max_waiting 1
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        big = h.post("/v1/completions", json={"prompt": "y" * 5000}, headers=auth)
        assert big.status_code == 413
        locked.app.state.engine.accepting = False  # what SIGTERM sets: new work is refused, not hung
        try:
            assert h.post("/v1/completions", json=body, headers=auth).status_code == 503
            assert h.get("/health").status_code == 503
        finally:
            locked.app.state.engine.accepting = True
    ok = openai.OpenAI(base_url=locked.url + "/v1", api_key="sekret", max_retries=0)
    assert ok.completions.create(model=ok.models.list().data[0].id, prompt="x", max_tokens=1).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "tell me a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.monotonic()
    with httpx.Client(timeout=30) as h, h.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.engine.block_pool.num_free < server.engine.block_pool.num_blocks
    assert _idle(server, timeout=8)
    assert time.monotonic() - start < 8  # 400 tokens take far longer: the request was aborted
    assert 'deepinfer_requests_finished_total{reason="abort"}' in httpx.get(server.url + "/metrics").text


_any = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                    max_leaves=6)
_fields = {
    "model": st.sampled_from([MODEL, "x"]) | _any, "prompt": st.text(max_size=10) | st.lists(st.integers(-5, 200000),
    max_size=4) | _any, "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system",
    "assistant", "tool", "bogus"]), "content": st.text(max_size=8) | _any}), max_size=3) | _any,
    "temperature": _any, "top_p": _any, "top_k": _any, "n": st.integers(-1, 3) | _any, "stop": _any, "seed": _any,
    "logprobs": _any, "top_logprobs": _any, "stream": st.booleans() | _any, "stream_options": _any,
    "chat_template_kwargs": _any, "echo": _any, "stop_token_ids": _any,
}
_body = st.fixed_dictionaries({"max_tokens": st.sampled_from([-1, 0, 1, 2, "3", 2.0, None])},
                              optional=_fields) | _any


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=_body)
def test_fuzzed_bodies_never_5xx(server, path, body):
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body["max_tokens"] = 1  # an absent max_tokens means "the whole context": slow, not interesting
    r = httpx.post(server.url + path, content=json.dumps(body), timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_async_scheduling_server_streams_the_offline_text_and_frees_aborted_blocks(tiny_v4_dir, offline):
    """The server's engine loop with asynchronous scheduling (the CUDA default; here forced on the CPU):
    a stream equals the offline text, and a client leaving mid-stream, while a step of its request is in
    flight, gets every block back."""
    with ThreadedServer(ServerConfig(model=str(tiny_v4_dir), served_model_name=MODEL, port=0,
                                     async_scheduling=True, **ENGINE)) as s:
        assert s.engine.async_scheduling
        ref = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                                temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        body = {"prompt": "tell me a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        assert _idle(s, timeout=8)


def test_a_stopped_server_lets_its_engine_go(tiny_v4_dir):
    """After a server stops, nothing keeps its engine (and model) alive. FastAPI caches endpoint callables in
    a module-level cache, so an endpoint closing over the engine had kept every app's model: ~650 MB a
    server of the tiny model, in tests, notebooks and any process that restarts its server."""
    import gc
    import weakref

    with ThreadedServer(ServerConfig(model=str(tiny_v4_dir), served_model_name=MODEL, port=0, **ENGINE)) as s:
        engine = weakref.ref(s.engine)
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            assert httpx.post(s.url + path, json=body, timeout=30).status_code == 200
        for path in ("/health", "/v1/models", "/metrics"):
            assert httpx.get(s.url + path, timeout=30).status_code == 200
    del s
    gc.collect()
    assert engine() is None
