"""Prompt logprobs: every prompt token's logprob under the request's routing equals a full-sequence forward's
log-softmax (base, a pinned adapter, a learned router with and without a probe pass), in any batch, chunked or
preempted, past the prefix cache; max_new_tokens 0 scores without generating; requests that do not ask are
unchanged; the server's echo and vLLM's prompt_logprobs write them in OpenAI's and vLLM's shapes."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.routing import SequenceRouter
from molora.server.app import create_app
from tests.conftest import VOCAB, make_peft_adapter, tiny_model, tiny_tokenizer

ARCH = "qwen3"
TOL = 1e-4  # float32 logprobs of two forwards that group their sums differently
CFG = EngineConfig(
    max_num_seqs=8, max_tokens_per_step=48, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False
)
CHUNKED = EngineConfig(  # prompts split over several steps; 20 blocks make the busy batch preempt
    max_num_seqs=8, max_tokens_per_step=10, block_size=4, num_kv_blocks=20, max_model_len=64, stop_at_eos=False
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(root / "a", ARCH, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=1),
        "b": make_peft_adapter(root / "b", ARCH, r=8, alpha=4, targets=("k_proj", "o_proj", "up_proj"), seed=2),
    }


def _mm(paths, router: str | None = None):
    mm = molora.attach(tiny_model(ARCH), dict(paths), target_modules=LLAMA_PROJECTIONS)
    if router is not None:
        from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

        probe = router == "probe"
        cfg = LearnedRouterConfig(
            ("b", "a"),
            mm.config.hidden_size,
            len(decoder_layers(mm.model)),
            carry_blocks=1 if probe else 0,
            probe_prompt=probe,
        )
        mm.router = LearnedRouter(cfg)
        with torch.no_grad():
            mm.router.weight.normal_(generator=torch.Generator().manual_seed(0))
    return mm


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _reference(mm, prompt: list[int], spec) -> torch.Tensor:
    """[P, V] log-softmax of one full-sequence forward of the prompt under `spec` (an adapter name, None for the
    base, or mm.router), as mm.generate routes its prompt (a probing router: its probe's decisions fixed)."""
    ids = torch.tensor([prompt])
    if spec is mm.router and spec is not None:
        fixed = None
        if getattr(spec, "probe_prompt", False):
            mm(ids, adapter_ids=spec, use_cache=False, logits_to_keep=1)
            fixed = spec.prompt_routes(mm.last_carry, torch.ones_like(ids))
        logits = mm(ids, adapter_ids=spec, fixed=fixed, use_cache=False).logits
    else:
        logits = mm(ids, adapter_ids=SequenceRouter(spec), use_cache=False).logits
    return logits[0].float().log_softmax(-1)


def _check(scores: list[dict | None], prompt: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    got = torch.tensor([e["logprob"] for e in scores[1:]])
    want = ref[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert (got - want).abs().max().item() < TOL
    for p, e in enumerate(scores[1:]):
        assert e["token_id"] == prompt[p + 1]
        own = ref[p, prompt[p + 1]]  # a flat random model's near-ties may order either way within TOL
        assert int((ref[p] > own + TOL).sum()) < e["rank"] <= int((ref[p] > own - TOL).sum()) + 1
        vals = ref[p].topk(top).values
        assert torch.allclose(torch.tensor([v for _, v in e["top"]]), vals, atol=TOL)
        assert all(abs(ref[p, i] - v) < TOL for i, v in e["top"])


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("mode", ["base", "pinned", "learned", "probe"])
def test_prompt_logprobs_equal_a_full_forward_alone_and_chunked_in_a_busy_preempting_batch(paths, mode):
    mm = _mm(paths, mode if mode in ("learned", "probe") else None)
    spec = {"base": None, "pinned": "a"}.get(mode, mm.router)
    kw = {"base": dict(routing="none"), "pinned": dict(adapter="a")}.get(mode, {})
    prompt = _prompt(27, 3)
    ref = _reference(mm, prompt, spec)
    params = SamplingParams(max_new_tokens=4, prompt_logprobs=3)
    alone = Engine(mm, CFG).generate([prompt], params, **kw)[0]
    _check(alone.prompt_logprobs, prompt, ref, 3)

    engine = Engine(mm, CHUNKED)  # 10 tokens a step: the prompt spans three chunks, beside others
    others = [engine.add_request(_prompt(20 + i, 10 + i), SamplingParams(max_new_tokens=16)) for i in range(5)]
    rid = engine.add_request(prompt, params, **kw)
    scores, new = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                assert out.prompt_logprobs is None or scores is None, "prompt logprobs are given once"
                scores = out.prompt_logprobs if out.prompt_logprobs is not None else scores
                new += out.new_token_ids
        engine.scheduler.check()
    assert others and engine.stats()["num_preemptions"] > 0
    _check(scores, prompt, ref, 3)
    assert new == alone.new_token_ids


def test_max_new_tokens_zero_scores_the_prompt_and_generates_nothing(paths):
    mm = _mm(paths)
    engine = Engine(mm, CHUNKED)
    prompt = _prompt(23, 4)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=0), adapter="b")[0]
    assert out.finish_reason == "length" and out.new_token_ids == [] and out.completion_tokens == 0
    _check(out.prompt_logprobs, prompt, _reference(mm, prompt, "b"), 0)
    assert engine.allocator.num_free == engine.allocator.num_blocks and not engine.requests
    one = engine.generate([[7]], SamplingParams(max_new_tokens=0, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None] and one.finish_reason == "length"
    with pytest.raises(MoLoRAError, match="max_new_tokens=-1"):
        SamplingParams(max_new_tokens=-1)
    with pytest.raises(MoLoRAError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)


def test_requests_that_do_not_ask_are_unchanged_and_the_prefix_cache_is_passed_by(paths):
    mm = _mm(paths)
    prompts = [_prompt(18, 5), _prompt(9, 6), _prompt(30, 7)]
    plain = SamplingParams(max_new_tokens=6, logprobs=2)
    before = Engine(mm, CFG).generate(prompts, plain, adapter=["a", None, "b"])
    engine = Engine(mm, CFG)
    mixed = engine.generate(
        prompts,
        [plain, SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=1), plain],
        adapter=["a", None, "b"],
    )
    for b, m in zip(before, mixed):
        assert m.new_token_ids == b.new_token_ids and m.logprobs == b.logprobs
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None
    # the same prompt again: a plain request takes its cached blocks, a scoring one computes every position
    again = engine.generate([prompts[2]] * 2, [plain, SamplingParams(max_new_tokens=6, prompt_logprobs=1)], adapter="b")
    assert again[0].cached_tokens > 0 and again[1].cached_tokens == 0
    assert again[1].new_token_ids == before[2].new_token_ids
    _check(again[1].prompt_logprobs, prompts[2], _reference(mm, prompts[2], "b"), 1)


# ------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def served(paths):
    mm = _mm(paths)
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # a chat is its words
    engine = Engine(mm, CFG, tokenizer=tok)
    with TestClient(create_app(engine, model_name="toy")) as client:
        yield client, mm


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_echo_returns_the_prompt_and_its_logprobs_then_the_completion(served):
    client, mm = served
    prompt = _prompt(12, 8)
    ref = _reference(mm, prompt, "a")
    want = ref[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    body = {"model": "toy:a", "prompt": _words(prompt), "echo": True, "logprobs": 1, "temperature": 0}
    r = client.post("/v1/completions", json={**body, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == _words(prompt) and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0 and "prompt_logprobs" not in choice
    assert lp["tokens"] == [f"w{i}" for i in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert max(abs(g - w) for g, w in zip(lp["token_logprobs"][1:], want)) < TOL
    assert all(f"w{t}" in top and len(top) <= 2 for t, top in zip(prompt[1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and len(lp["text_offset"]) == len(prompt)

    gen = client.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
    plain = client.post("/v1/completions", json={**body, "echo": False, "max_tokens": 3}).json()["choices"][0]
    assert gen["text"] == _words(prompt) + plain["text"]
    assert gen["logprobs"]["tokens"] == lp["tokens"] + plain["logprobs"]["tokens"]
    assert gen["logprobs"]["token_logprobs"][: len(prompt)] == lp["token_logprobs"]
    assert gen["logprobs"]["token_logprobs"][len(prompt) :] == plain["logprobs"]["token_logprobs"]
    assert gen["logprobs"]["text_offset"][len(prompt)] == len(_words(prompt))


def test_token_id_prompts_batched_and_vllm_prompt_logprobs(served):
    client, mm = served
    prompts = [_prompt(9, 9), _prompt(14, 10)]
    r = client.post(
        "/v1/completions",
        json={"model": "toy", "prompt": prompts, "echo": True, "logprobs": 0, "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, c in zip(prompts, choices):
        ref = _reference(mm, prompt, None)
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and c["text"].startswith(_words(prompt))
        assert all(top is None or set(top) <= {lp["tokens"][k]} for k, top in enumerate(lp["top_logprobs"][:-1]))
        vllm = c["prompt_logprobs"]
        assert len(vllm) == len(prompt) and vllm[0] is None
        for p, entry in enumerate(vllm[1:]):
            own = entry[str(prompt[p + 1])]
            assert abs(own["logprob"] - ref[p, prompt[p + 1]].item()) < TOL
            assert own["decoded_token"] == f"w{prompt[p + 1]}"
            top = ref[p].topk(2).indices.tolist()
            assert all(str(i) in entry for i in top) and entry[str(top[0])]["rank"] == 1
            assert abs(lp["token_logprobs"][p + 1] - own["logprob"]) < 1e-6


def test_chat_prompt_logprobs_and_streamed_echo(served):
    client, _ = served
    chat = {"model": "toy", "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    vllm = r.json()["prompt_logprobs"]
    assert vllm[0] is None and all(len(e) >= 1 for e in vllm[1:])
    assert "prompt_logprobs" not in client.post("/v1/chat/completions", json=chat).json()
    body = {"model": "toy", "prompt": "w5 w6 w7", "echo": True, "max_tokens": 2, "stream": True, "logprobs": 1}
    with client.stream("POST", "/v1/completions", json=body) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("w5 w6 w7") and first["logprobs"]["token_logprobs"][0] is None
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == 3 + 2


def test_bad_prompt_logprob_requests_get_a_400_naming_the_field(served):
    client, _ = served
    base = {"model": "toy", "prompt": "w3 w4", "max_tokens": 1}
    chat = {"model": "toy", "messages": [{"role": "user", "content": "w3"}]}
    cases = [
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/completions", {**base, "logprobs": 21, "echo": True}, "logprobs"),
        ("/v1/completions", {**base, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {**base, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {**base, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {**base, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**base, "max_tokens": -1, "echo": True}, "max_tokens"),
    ]
    for path, body, param in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
