"""The step sampler is batched over the step's rows and still picks, row by row, what one row alone would pick:
`filter_logits_rows` equals `filter_logits` per row bit for bit, and `sample_step` equals the plain per-row loop
(the spec below: stop ids masked for min_tokens, greedy, or a draw from the request's own generator)."""

from __future__ import annotations

import random

import pytest
import torch

from molora.config import SamplingParams
from molora.engine.request import Request
from molora.engine.sampler import sample_step, step_logprobs
from molora.errors import MoLoRAError
from molora.sampling import filter_logits, filter_logits_rows, greedy, sample_next, top_logprobs

V = 97
EOS = frozenset({2, 500})  # 500 lies outside the vocabulary: left out, as the engine does


def _params(rng: random.Random) -> SamplingParams:
    greedy_row = rng.random() < 0.3
    return SamplingParams(
        max_new_tokens=8,
        temperature=0.0 if greedy_row else rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40, V, V + 3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        min_tokens=rng.choice([0, 0, 2]),
        stop_token_ids=rng.choice([[], [7], [7, 11]]),
        logprobs=rng.choice([0, 0, 1, 3]),
        seed=rng.randrange(1000),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_logits_rows_equals_filter_logits_row_by_row(dtype):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = rng.randint(1, 9)
        logits = (torch.randn(b, V, generator=g) * 3).to(dtype)
        logits[0, :5] = logits[0, 5]  # ties at the top
        ps = [_params(rng) for _ in range(b)]
        temps = [p.temperature or 1.0 for p in ps]
        got = filter_logits_rows(logits, temps, [p.top_k for p in ps], [p.top_p for p in ps])
        for j, p in enumerate(ps):
            want = filter_logits(logits[j : j + 1], temps[j], p.top_k, p.top_p)
            assert torch.equal(got[j : j + 1], want), (j, p)


def test_filter_logits_rows_refuses_a_parameter_list_of_the_wrong_length():
    with pytest.raises(MoLoRAError, match="one of each per row"):
        filter_logits_rows(torch.zeros(3, V), [1.0, 1.0], [0, 0, 0], [1.0, 1.0, 1.0])


def _requests(rng: random.Random, b: int) -> list[Request]:
    reqs = []
    for j in range(b):
        p = _params(rng)
        gen = None if p.greedy else torch.Generator().manual_seed(p.seed)
        req = Request(f"r{j}", [3, 4, 5], p, route=None, generator=gen)
        req.tokens += [9] * rng.randint(0, 3)  # some are past their min_tokens
        reqs.append(req)
    return reqs


def _one_row(req: Request, row: torch.Tensor, finite: bool, gen: torch.Generator | None) -> int:
    """The spec: what one row picks on its own."""
    p = req.params
    if req.num_generated < p.min_tokens:
        row = row.clone()
        row[0, sorted(t for t in EOS | set(p.stop_token_ids) if t < V)] = float("-inf")
    pick = int(greedy(row)[0])
    if not p.greedy and finite:
        pick = int(sample_next(row, p.temperature, p.top_k, p.top_p, gen)[0])
    return pick


def test_sample_step_equals_the_per_row_loop_and_leaves_logits_untouched():
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        b = rng.randint(1, 8)
        reqs = _requests(rng, b)
        logits = torch.randn(b, V, generator=g) * 2
        for j in range(b):  # a stop id on top: min_tokens must mask it
            logits[j, rng.choice([2, 7, 11, 40])] += 8
        finite = [rng.random() > 0.1 for _ in range(b)]
        before = logits.clone()
        gens = [None if r.generator is None else torch.Generator().manual_seed(r.params.seed) for r in reqs]
        want = [_one_row(r, logits[j : j + 1], finite[j], gens[j]) for j, r in enumerate(reqs)]
        chosen, dead = sample_step(reqs, logits, finite, EOS)
        assert dead == {} and chosen.tolist() == want
        assert torch.equal(logits, before)
        # each generator drew exactly as much as the row alone did: the next draw agrees too
        for r, gen in zip(reqs, gens):
            if r.generator is not None:
                assert torch.equal(torch.rand(3, generator=r.generator), torch.rand(3, generator=gen))


def test_a_seeded_row_samples_the_same_id_in_any_batch():
    rng = random.Random(2)
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, V, generator=g)
    alone = Request(
        "a",
        [3],
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=5),
        route=None,
        generator=torch.Generator().manual_seed(5),
    )
    want = sample_step([alone], row, [True], EOS)[0].tolist()
    for _ in range(5):
        crowd = _requests(rng, rng.randint(1, 6))
        req = Request("a", [3], alone.params, route=None, generator=torch.Generator().manual_seed(5))
        at = rng.randint(0, len(crowd))
        reqs = crowd[:at] + [req] + crowd[at:]
        logits = torch.cat([torch.randn(at, V, generator=g), row, torch.randn(len(crowd) - at, V, generator=g)])
        chosen, _ = sample_step(reqs, logits, [True] * len(reqs), EOS)
        assert chosen[at : at + 1].tolist() == want


def test_step_logprobs_equal_each_row_alone():
    rng = random.Random(3)
    reqs = _requests(rng, 8)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    chosen = greedy(logits)
    got = step_logprobs(reqs, logits, chosen)
    for j, req in enumerate(reqs):
        n = req.params.logprobs
        if n == 0:
            assert got[j] is None
            continue
        lp, vals, ids = top_logprobs(logits[j][None], chosen[j].reshape(1), n)
        assert got[j] == [
            {
                "token_id": int(chosen[j]),
                "logprob": float(lp[0]),
                "top": [(int(i), float(v)) for i, v in zip(ids[0], vals[0])],
            }
        ]
