"""The OpenAI-compatible server, tested over a fake engine (no model) plus one run on the real engine.

The fake engine implements the engine contract with a byte-level toy tokenizer and deterministic tokens,
records aborts, and asserts that every call comes from one thread (the engine is single-threaded).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molora.config import SamplingParams
from molora.errors import AdapterError, AdapterNotFound, MoLoRAError
from molora.server import ServerThread, create_app
from molora.server.launch import free_port

ALPHABET = "abcdefghij "
EOS, IM_END, UNK = 256, 257, 258
SPECIALS = {EOS: "<eos>", IM_END: "<|im_end|>", UNK: "<unk>"}


class ToyTokenizer:
    """One token per UTF-8 byte (ids 0..255) plus three special tokens."""

    eos_token_id, unk_token_id = EOS, UNK
    chat_template = "toy"

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i in SPECIALS:
                out.append(buf.decode(errors="replace") + ("" if skip_special_tokens else SPECIALS[i]))
                buf = bytearray()
            else:
                buf.append(i)
        return "".join(out) + buf.decode(errors="replace")

    def convert_tokens_to_ids(self, token: str) -> int:
        return {v: k for k, v in SPECIALS.items()}.get(token, UNK)

    def apply_chat_template(
        self, conversation: list[dict], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in conversation) + "<assistant>"


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_adapters: list[str | None]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None


class FakeHotSet:
    """The parts of `HotSet` that Ray placement reads: `num_slots` slots in LRU order (a request's adapters are
    loaded when it is added), no CPU tier."""

    def __init__(self, num_slots: int) -> None:
        self.mm = SimpleNamespace(bank=SimpleNamespace(names=[], num_slots=num_slots))
        self.wanted: set[str] = set()
        self.cpu: dict = {}

    def resident(self, name: str) -> bool:
        return name in self.mm.bank.names

    def use(self, names) -> None:
        slots = self.mm.bank.names
        for n in names:
            if n in slots:
                slots.remove(n)
            slots.append(n)
        del slots[: max(0, len(slots) - self.mm.bank.num_slots)]


class FakeEngine:
    """The engine contract, deterministic: token k of a request is ALPHABET[(sum(prompt) + seed + k) % 11]."""

    def __init__(
        self, adapters=("math", "code"), *, step_delay: float = 0.0, max_model_len: int = 128, num_slots: int = 8
    ) -> None:
        self.tokenizer = ToyTokenizer()
        self.hotset = FakeHotSet(num_slots)
        self.mm = SimpleNamespace(
            adapter_names=list(adapters),
            tokenizer=self.tokenizer,
            bundle=SimpleNamespace(name="toy", prompt_template="<user>{prompt}\n<assistant>", stop=("<|im_end|>",)),
            config=SimpleNamespace(vocab_size=259),
        )
        self.step_delay, self.max_model_len = step_delay, max_model_len
        self.running: dict[str, dict] = {}
        self.added: list[dict] = []
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.tokens_by_adapter: dict[str, int] = {}
        self.steps = self.tokens = 0
        self._thread: int | None = None

    def _same_thread(self) -> None:
        self._thread = self._thread or threading.get_ident()
        assert self._thread == threading.get_ident(), "engine called from two threads"

    def add_request(
        self,
        prompt_ids,
        params: SamplingParams,
        *,
        request_id=None,
        adapter=None,
        allowed_adapters=None,
        routing="auto",
        timeout_s=None,
        queue_timeout_s=None,
        tenant=None,
        priority=0,
    ) -> str:
        self._same_thread()
        for name in [adapter] + list(allowed_adapters or []):
            if name is not None and name not in self.mm.adapter_names:
                raise AdapterNotFound(f"unknown adapter(s) [{name!r}]")  # as the engine's hot set says it
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise MoLoRAError("prompt too long")
        assert request_id not in self.running
        pool = [adapter] if adapter else list(allowed_adapters or self.mm.adapter_names) or [None]
        self.hotset.use([a for a in pool if a is not None])
        req = dict(
            id=request_id,
            prompt=list(prompt_ids),
            params=params,
            pool=pool,
            text="",
            emitted=0,
            n=0,
            adapter=adapter,
            allowed=allowed_adapters,
            routing=routing,
            tenant=tenant,
            priority=priority,
        )
        self.running[request_id] = req
        self.added.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        self._same_thread()
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        self._same_thread()
        return bool(self.running)

    def step(self) -> list[FakeOutput]:
        self._same_thread()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("simulated kernel failure")
        time.sleep(self.step_delay)
        self.steps += 1
        return [self._advance(r) for r in list(self.running.values())]

    def _advance(self, r: dict) -> FakeOutput:
        p: SamplingParams = r["params"]
        tok = ord(ALPHABET[(sum(r["prompt"]) + (p.seed or 0) + r["n"]) % len(ALPHABET)])
        adapter = r["pool"][r["n"] % len(r["pool"])]
        r["n"] += 1
        r["text"] += chr(tok)
        self.tokens += 1
        self.tokens_by_adapter[adapter or "base"] = self.tokens_by_adapter.get(adapter or "base", 0) + 1
        hits = [r["text"].find(s) for s in p.stop if s in r["text"]]
        reason = "stop" if hits else ("length" if r["n"] >= p.max_new_tokens else None)
        holdback = max([len(s) for s in p.stop] + [1]) - 1  # a stop string may still be completing
        end = min(hits) if hits else (len(r["text"]) if reason else len(r["text"]) - holdback)
        new_text = r["text"][r["emitted"] : max(end, r["emitted"])]
        r["emitted"] += len(new_text)
        if reason:
            del self.running[r["id"]]
        lp = (
            [{"token_id": tok, "logprob": -0.25, "top": [(tok, -0.25), (ord("z"), -2.0)][: p.logprobs]}]
            if p.logprobs
            else None
        )
        return FakeOutput(r["id"], [tok], new_text, [adapter], reason is not None, reason, len(r["prompt"]), r["n"], lp)

    def stats(self) -> dict:
        self._same_thread()
        return dict(
            num_waiting=0,
            num_running=len(self.running),
            kv_blocks_total=64,
            kv_blocks_free=64 - 2 * len(self.running),
            tokens_generated=self.tokens,
            steps=self.steps,
            tokens_by_adapter=dict(self.tokens_by_adapter),
            hotset=dict(hits=7, misses=2, evictions=1, load_ms_total=12.5, slots=4),
        )

    def read_adapter(self, name: str, path: str, roots=None) -> str:  # any thread: files only
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"{path}: no adapter_config.json")
        return path

    def load_adapter(self, name: str, adapter: str, roots=None) -> None:
        self._same_thread()
        self.mm.adapter_names.append(name)

    def load_adapter_stages(self, name: str, adapter: str, roots=None):  # a load in stages: one stage here
        self.load_adapter(name, adapter, roots)
        yield from ()

    def unload_adapter(self, name: str, force: bool = False) -> str:
        self._same_thread()
        self.mm.adapter_names.remove(name)
        return "unloaded"

    def reset(self, why: str) -> list:
        self._same_thread()
        self.running.clear()
        return []

    def list_adapters(self) -> list[dict]:  # also called by create_app, before the engine thread starts
        return [{"name": n, "path": Path("/adapters") / n} for n in self.mm.adapter_names]


def expected_text(prompt_ids: list[int], n: int, seed: int = 0) -> str:
    return "".join(ALPHABET[(sum(prompt_ids) + seed + k) % len(ALPHABET)] for k in range(n))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, max_queue=64), raise_server_exceptions=True) as c:
        yield c


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ openai client


def test_openai_client_completions_stream_and_chat(engine):
    import openai  # a test dependency (the [test] extra): missing, it fails here rather than skipping

    with ServerThread(create_app(engine)) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        r = c.completions.create(model="toy", prompt="hello", max_tokens=6, temperature=0)
        assert r.choices[0].text == expected_text(list(b"hello"), 6)
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 6, 11)

        parts = [
            ch.choices[0].text
            for ch in c.completions.create(model="toy", prompt="hello", max_tokens=6, stream=True)
            if ch.choices
        ]
        assert "".join(parts) == r.choices[0].text

        chat = c.chat.completions.create(
            model="toy:math",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"molora": {"return_routing": True}},
        )
        prompt_ids = list(b"<user>hi\n<assistant>")  # the bundle's template on a single user message
        assert chat.choices[0].message.content == expected_text(prompt_ids, 4)
        assert chat.choices[0].model_extra["molora"]["adapters"] == ["math"] * 4
        assert chat.usage.prompt_tokens == len(prompt_ids)

        stream = c.chat.completions.create(
            model="toy",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == expected_text(list(b"<system>be brief\n<user>hi\n<assistant>"), 5)
        assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices

        models = {m.id: m.model_extra.get("parent") for m in c.models.list()}
        assert models == {"toy": None, "math": "toy", "code": "toy"}  # vLLM's form: an adapter's parent is its base


def test_32_concurrent_clients_with_mixed_adapters_all_succeed():
    import openai  # a test dependency (the [test] extra): missing, it fails here rather than skipping

    engine = FakeEngine(step_delay=0.002)
    models = ["toy", "toy:math", "toy:code"]

    async def one(c, i: int):
        model = models[i % 3]
        extra = {"molora": {"return_routing": True}}
        if i % 2:
            r = await c.completions.create(model=model, prompt=f"req {i}", max_tokens=8, extra_body=extra)
            return model, r.choices[0].model_extra["molora"]["adapters"], r.choices[0].text
        parts, adapters = [], []
        async for ch in await c.completions.create(
            model=model, prompt=f"req {i}", max_tokens=8, stream=True, extra_body=extra
        ):
            parts.append(ch.choices[0].text)
            adapters += ch.choices[0].model_extra["molora"]["adapters"]
        return model, adapters, "".join(parts)

    async def main(url):
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    with ServerThread(create_app(engine)) as url:
        results = asyncio.run(main(url))
    for i, (model, adapters, text) in enumerate(results):
        assert text == expected_text(list(f"req {i}".encode()), 8)
        pinned = model.partition(":")[2]
        assert adapters == ([pinned] * 8 if pinned else ["math", "code"] * 4)
    assert max(len(a["prompt"]) for a in engine.added) > 0 and len(engine.added) == 32


# ------------------------------------------------------------------------------------------ semantics


def test_n_seed_stop_logprobs_and_batched_prompts(client):
    r = client.post(
        "/v1/completions",
        json={"model": "toy", "prompt": ["ab", "cd"], "n": 2, "seed": 3, "max_tokens": 4, "logprobs": 2},
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] == expected_text(list(b"ab"), 4, seed=3)
    assert r["choices"][1]["text"] == expected_text(list(b"ab"), 4, seed=4)  # choice j samples with seed + j
    assert r["choices"][2]["text"] == expected_text(list(b"cd"), 4, seed=3)
    assert r["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 16,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "molora" not in r["choices"][0]  # routing is reported only on request
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and len(lp["top_logprobs"][0]) == 2 and lp["text_offset"][:2] == [0, 1]

    full = expected_text(list(b"zz"), 10)
    stop = full[4:6]
    r = client.post("/v1/completions", json={"model": "toy", "prompt": "zz", "max_tokens": 10, "stop": stop}).json()
    assert r["choices"][0]["text"] == full[: full.find(stop)] and r["choices"][0]["finish_reason"] == "stop"

    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "toy",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 1,
            "max_tokens": 2,
        },
    ).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 1 and content[0]["bytes"]


def test_molora_options_reach_the_engine(client, engine):
    body = {
        "model": "toy",
        "prompt": "q",
        "max_tokens": 2,
        "molora": {"routing": "vocab", "adapters": ["code"], "return_routing": True},
    }
    r = client.post("/v1/completions", json=body).json()
    assert r["choices"][0]["molora"]["adapters"] == ["code", "code"]
    req = engine.added[-1]
    assert (req["adapter"], req["allowed"], req["routing"]) == (None, ["code"], "vocab")
    assert req["params"].stop_token_ids == (EOS, IM_END)


# ------------------------------------------------------------------------------------------ errors


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client):
    post = client.post
    assert_error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/completions", content=b'{"model": "toy", "prompt": "a"}'), 415, "Content-Type")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": 5}), 400, "prompt")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "max_tokens": 0}), 400, "max_tokens")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "temperature": "1"}), 400, "temperature")
    assert_error(post("/v1/completions", json={"model": "nope", "prompt": "a"}), 404, "model")
    assert_error(post("/v1/completions", json={"model": "toy:nope", "prompt": "a"}), 404, "model")
    assert_error(
        post("/v1/completions", json={"model": "toy", "prompt": "a", "molora": {"adapters": ["x"]}}),
        404,
        "molora.adapters",
    )
    err = assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a" * 200}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "max_tokens": 1000}), 400, "max_tokens")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": [300]}), 400, "prompt")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "n": 99}), 400, "n")
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": ["a"] * 8, "n": 16}), 400, "n")  # > capacity
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "presence_penalty": 3}), 400)
    assert_error(post("/v1/completions", json={"model": "toy", "prompt": "a", "frobnicate": 1}), 400, "frobnicate")
    assert_error(post("/v1/chat/completions", json={"model": "toy", "messages": []}), 400, "messages")
    tool_message = {"model": "toy", "messages": [{"role": "tool", "content": "x"}]}
    assert_error(post("/v1/chat/completions", json=tool_message), 400)
    assert_error(post("/v1/completions", content=b"x" * (5 << 20)), 413)
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert post("/v1/completions", json={"model": "toy", "prompt": "ok", "max_tokens": 3}).status_code == 200


def test_engine_failure_fails_the_request_not_the_server(client, engine):
    engine.fail_next_step = True
    err = assert_error(client.post("/v1/completions", json={"model": "toy", "prompt": "a"}), 500)
    assert err["code"] == "engine_error"
    assert client.post("/v1/completions", json={"model": "toy", "prompt": "a"}).status_code == 200


def test_saturation_answers_429_with_retry_after():
    engine = FakeEngine(step_delay=0.01)
    with ServerThread(create_app(engine, max_queue=2)) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": "toy", "prompt": "a", "max_tokens": 100, "stream": True}
        with http.stream("POST", "/completions", json=body) as s1, http.stream("POST", "/completions", json=body):
            lines = s1.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            r = http.post("/completions", json={"model": "toy", "prompt": "b"})
            assert_error(r, 429)
            assert r.headers["retry-after"] == "1"
        wait_for(lambda: not engine.running)
        assert http.post("/completions", json={"model": "toy", "prompt": "b"}).status_code == 200


# ------------------------------------------------------------------------------------------ fuzz

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
TOKENS = st.lists(st.integers(-3, 300), max_size=6)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"])},
    optional={
        "content": st.text(max_size=12)
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5)}),
            max_size=2,
        )
        | st.none(),
        "name": st.text(max_size=4),
    },
)
# near-valid values per field (boundaries, wrong-but-close types); any field may also get arbitrary JSON
NEAR = {
    "model": st.sampled_from(["toy", "toy:math", "toy:code", "toy:nope", "toy:", "", "other"]),
    "prompt": st.text(max_size=30) | TOKENS | st.lists(st.text(max_size=6), max_size=3) | st.lists(TOKENS, max_size=3),
    "messages": st.lists(MESSAGE, max_size=3),
    "max_tokens": st.integers(-2, 200) | st.none(),
    "max_completion_tokens": st.integers(-1, 50),
    "temperature": st.floats(-1, 3) | st.integers(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 300),
    "n": st.integers(-1, 20),
    "stream": st.booleans(),
    "seed": st.integers(-(2**64), 2**64),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | st.none(),
    "logprobs": st.integers(-1, 25) | st.booleans() | st.none(),
    "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "best_of": st.integers(0, 4),
    "presence_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(
        st.text(max_size=3) | st.integers(-2, 300).map(str), st.floats(-150, 150), max_size=2
    ),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "min_p": st.floats(-0.5, 1.5),
    "bad_words": st.lists(st.text(max_size=4), max_size=3),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "molora": st.fixed_dictionaries(
        {},
        optional={
            "routing": st.sampled_from(["auto", "learned", "vocab", "sequence", "x"]),
            "adapters": st.lists(st.sampled_from(["math", "code", "?"]), max_size=3) | st.none(),
            "return_routing": st.booleans(),
        },
    ),
}
BASES = {
    "/v1/completions": {"model": "toy", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """A valid body with 0-4 fields replaced, added or removed; sometimes arbitrary JSON or bytes."""
    path = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.sampled_from(["mutated"] * 8 + ["json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40))
    if kind == "json":
        return path, json.dumps(draw(JSON), allow_nan=True).encode()
    body = dict(BASES[path])
    for field in draw(st.lists(st.sampled_from(sorted(NEAR)), max_size=4, unique=True)):
        body[field] = draw(NEAR[field] | JSON) if draw(st.integers(0, 4)) else draw(JSON)
    for field in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[field]
    return path, json.dumps(body, allow_nan=True).encode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_fuzzed_bodies_never_get_a_5xx(client, case):
    path, body = case
    r = client.post(path, content=body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif "text/event-stream" in r.headers["content-type"]:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------------------------------ disconnects


def test_client_disconnect_aborts_stream_and_non_stream_requests():
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": "toy", "prompt": "a", "max_tokens": 100}
        with http.stream("POST", "/completions", json={**body, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: len(engine.aborted) == 1)
        with pytest.raises(httpx.ReadTimeout):
            http.post("/completions", json=body, timeout=0.2)
        wait_for(lambda: len(engine.aborted) == 2)
        wait_for(lambda: app.state.molora.client.in_flight == 0 and not engine.running)


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    port = free_port()
    code = (
        "import sys; from tests.test_server import FakeEngine; from molora.server import serve; "
        f"serve(engine=FakeEngine(step_delay=0.02), port={port}, log_level='warning')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _up(url), timeout=30)
        with httpx.Client(base_url=url, timeout=10) as http:
            with http.stream(
                "POST", "/v1/completions", json={"model": "toy", "prompt": "a", "max_tokens": 40, "stream": True}
            ) as s:
                lines = s.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in rest[:-1])
            assert len(text) >= 30  # the stream ran on to the end after the signal
        # uvicorn re-raises the captured SIGTERM once drained, so the exit is the signal's (or 0)
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM), proc.stdout.read().decode()
        assert not _up(url)
    finally:
        if proc.poll() is None:
            proc.kill()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------------ auth, adapters, metrics


def test_api_keys_and_admin_keys(engine, tmp_path):
    root = tmp_path / "adapters"
    (root / "new").mkdir(parents=True)
    (root / "new" / "adapter_config.json").write_text("{}")
    app = create_app(engine, api_keys=["user-key"], admin_keys=["admin-key"], adapter_roots=[root])
    with TestClient(app) as c:
        body = {"model": "toy", "prompt": "a", "max_tokens": 2}
        r = c.post("/v1/completions", json=body)
        assert_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer user-key"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert_error(c.get("/metrics"), 401)
        load = {"name": "new", "path": "new"}
        assert_error(c.post("/v1/adapters", json=load, headers={"Authorization": "Bearer user-key"}), 403)
        r = c.post("/v1/adapters", json=load, headers={"Authorization": "Bearer admin-key"})
        assert r.status_code == 201, r.text


def test_adapter_paths_must_stay_under_the_roots(engine, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for folder in (root / "good", outside / "evil"):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
    (root / "link").symlink_to(outside / "evil")
    app = create_app(engine, adapter_roots=[root])
    with TestClient(app) as c:
        for path in ("../outside/evil", str(outside / "evil"), "link", "good/../../outside/evil", "/etc"):
            assert_error(c.post("/v1/adapters", json={"name": "x", "path": path}), 403, "path")
        assert_error(c.post("/v1/adapters", json={"name": "x", "path": "missing"}), 404, "path")
        assert_error(c.post("/v1/adapters", json={"name": "x", "path": "a\x00b"}), 400, "path")
        assert_error(c.post("/v1/adapters", json={"name": "../x", "path": "good"}), 400, "name")
        assert c.post("/v1/adapters", json={"name": "good", "path": "good"}).status_code == 201
        assert_error(c.post("/v1/adapters", json={"name": "good", "path": "good"}), 409)
        assert "good" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert {a["name"] for a in c.get("/v1/adapters").json()["data"]} == {"math", "code", "good"}
        assert c.post("/v1/completions", json={"model": "toy:good", "prompt": "a"}).status_code == 200
        assert c.delete("/v1/adapters/good").status_code == 200
        assert_error(c.delete("/v1/adapters/good"), 404)
        assert_error(c.post("/v1/completions", json={"model": "toy:good", "prompt": "a"}), 404)


def test_adapter_loading_is_disabled_without_roots(client):
    err = assert_error(client.post("/v1/adapters", json={"name": "x", "path": "good"}), 403)
    assert err["code"] == "adapter_loading_disabled"


def test_metrics_report_queue_latency_hotset_and_adapter_tokens(client):
    client.post("/v1/completions", json={"model": "toy:math", "prompt": "a", "max_tokens": 3})
    text = client.get("/metrics").text
    for needle in (
        "molora_requests_waiting 0",
        "molora_requests_running 0",
        "molora_tokens_per_second ",
        'molora_time_to_first_token_seconds_bucket{le="+Inf"} 1',
        "molora_time_per_output_token_seconds_count 1",
        "molora_hotset_hits_total 7",
        "molora_hotset_misses_total 2",
        "molora_hotset_evictions_total 1",
        'molora_adapter_tokens_total{adapter="math"} 3',
        "molora_completion_tokens_total 3",
        'molora_http_responses_total{code="200",route="/v1/completions"} 1',
    ):
        assert needle in text, needle


def test_draining_refuses_new_requests_with_503(client):
    client.app.state.molora.begin_drain()
    r = client.post("/v1/completions", json={"model": "toy", "prompt": "a"})
    assert_error(r, 503)
    assert r.headers["retry-after"] == "1"
    assert client.get("/health").json()["status"] == "draining"


# ------------------------------------------------------------------------------------------ real engine


def test_real_engine_behind_the_server_and_disconnect_frees_kv_blocks(tmp_path):
    import molora.engine as engine_mod
    from molora.model.attach import attach
    from molora.routing import VocabRouter
    from tests.conftest import make_peft_adapter, tiny_model

    paths = {n: make_peft_adapter(tmp_path / n, "qwen3", seed=i) for i, n in enumerate(("math", "code"))}
    mm = attach(
        tiny_model("qwen3"),
        paths,
        router=VocabRouter([(0, 64, "math")], default="code"),
        tokenizer=ToyTokenizer(),
        check_base=False,
    )
    engine = engine_mod.Engine(mm, engine_mod.EngineConfig(max_model_len=256, kv_budget_tokens=1024))
    app = create_app(engine, model_name="tiny")
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        free_at_start = _metric(http, "molora_kv_blocks_free")
        body = {
            "model": "tiny",
            "prompt": [5, 70, 9],
            "max_tokens": 5,
            "temperature": 0,
            "molora": {"return_routing": True},
        }
        r = http.post("/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["molora"]["token_ids"]) == r.json()["usage"]["completion_tokens"] <= 5
        assert set(choice["molora"]["adapters"]) <= {"math", "code"}
        assert http.post("/completions", json=body).json()["choices"][0]["text"] == choice["text"]  # greedy
        r = http.post("/completions", json={"model": "tiny:code", "prompt": [5, 6], "max_tokens": 3, "stream": True})
        assert r.text.rstrip().endswith("data: [DONE]")

        long = {
            "model": "tiny",
            "prompt": list(range(3, 60)),
            "max_tokens": 150,
            "stream": True,
            "temperature": 0.8,
            "seed": 1,
            "ignore_eos": True,
        }  # no early EOS: 150 steps of >= 10 ms
        step = engine.step
        engine.step = lambda: (time.sleep(0.01), step())[1]  # a tiny model could finish before the scrape
        with http.stream("POST", "/completions", json=long) as s:
            lines = s.iter_lines()
            next(lines)
            assert _metric(http, "molora_kv_blocks_free") < free_at_start  # the request holds blocks
        wait_for(lambda: app.state.molora.client.in_flight == 0, timeout=10)
        wait_for(lambda: _metric(http, "molora_kv_blocks_free") == free_at_start, timeout=10)
        assert _metric(http, "molora_requests_running") == 0


def _metric(http: httpx.Client, name: str) -> float:
    text = httpx.get(str(http.base_url).removesuffix("/v1/") + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_models_list_pages_with_limit_and_after(client):
    """GET /v1/models unchanged without paging; ?limit / ?after walk it in order with OpenAI's cursor fields."""
    full = client.get("/v1/models").json()
    assert set(full) == {"object", "data"} and len(full["data"]) >= 3
    ids = [m["id"] for m in full["data"]]
    seen, after = [], None
    while True:
        page = client.get("/v1/models", params={"limit": 2, **({"after": after} if after else {})}).json()
        seen += [m["id"] for m in page["data"]]
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids
    last = client.get("/v1/models", params={"after": ids[-1]}).json()
    assert last["data"] == [] and last["has_more"] is False and "first_id" not in last
    assert_error(client.get("/v1/models", params={"limit": 0}), 400, "limit")
    assert_error(client.get("/v1/models", params={"after": "no-such-model"}), 400, "after")
    assert client.get("/v1/models", params={"limit": "many"}).status_code == 400
