"""Data-free gates (molora.train.datafree): a pool the base model writes, labelled by which adapter moves its
answer most, and gates fitted on those labels."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.errors import MoLoRAError
from molora.routing.gates import GateConfig, GateRouter
from molora.train.datafree import gates_from_labels, label_prompts, sample_pool, sensitivity, zscores
from tests.conftest import make_peft_adapter, save_eos_prone_base

TEMPLATE = "w3 {prompt} w4"


def _bundle(tmp_path, zero: set[int] = frozenset()) -> molora.MoLoRAModel:  # type: ignore[name-defined]
    """A tiny bundle of two adapters whose base model ends a turn (eos, id 1) often; adapters in `zero` have B = 0
    (they change nothing)."""
    from safetensors.torch import load_file, save_file

    from molora.bundle import write_manifest

    base = tmp_path / "base"
    save_eos_prone_base(base)
    adapters = []
    for i in range(2):
        path = make_peft_adapter(tmp_path / f"e{i}", "llama", seed=i)
        if i in zero:
            f = path / "adapter_model.safetensors"
            t = load_file(str(f))
            save_file({k: (v * 0 if "lora_B" in k else v) for k, v in t.items()}, str(f))
        adapters.append({"name": f"e{i}", "path": str(path)})
    write_manifest(
        tmp_path,
        {"name": "d", "base": "base", "adapters": adapters, "prompt_template": TEMPLATE, "stop": ["<|im_end|>"]},
    )
    return molora.load(tmp_path)


def test_label_rule_picks_the_adapter_that_stands_out_and_leaves_the_rest_on_base():
    """z-scored per adapter: an adapter that moves every prompt a lot is not preferred for that; a prompt goes to
    an adapter only when its z reaches z_min and leads the runner-up by the margin."""
    g = torch.Generator().manual_seed(0)
    kl = torch.stack([torch.rand(40, generator=g) * 0.1 + 5.0, torch.rand(40, generator=g) * 0.1 + 0.01], 1)
    kl[3, 1] = 1.0  # only adapter 1 moves prompt 3 (far above its usual 0.01-0.11)
    kl[7, 0] = 50.0  # only adapter 0 moves prompt 7 far above its usual
    labels = label_prompts(kl, z_min=2.0, margin=1.0)
    assert labels[3] == 1 and labels[7] == 0
    assert (labels[[i for i in range(40) if i not in (3, 7)]] == -1).all()
    z = zscores(kl)
    assert torch.allclose(z.mean(0), torch.zeros(2), atol=1e-5)
    # a margin no adapter clears: nothing is labelled
    assert (label_prompts(kl, z_min=2.0, margin=100.0) == -1).all()


@torch.no_grad()
def test_sensitivity_is_zero_for_an_adapter_that_changes_nothing_and_labels_the_one_that_does(tmp_path):
    mm = _bundle(tmp_path, zero={0})
    prompts = [" ".join(f"w{5 + (7 * k + j) % 100}" for j in range(3 + k % 4)) for k in range(12)]
    s = sensitivity(mm, prompts, block=1, answer_tokens=4, batch=5)
    assert s["kl"].shape == (12, 2)
    assert torch.equal(s["kl"][:, 0], torch.zeros(12))  # B = 0: the answer's distributions are the base's
    assert (s["kl"][:, 1] > 0).all()
    assert [st.shape[0] for st in s["states"]] == [len(p.split()) + 2 for p in prompts]  # the templated prompt
    # batching does not change a prompt's numbers
    one = sensitivity(mm, prompts[4:5], block=1, answer_tokens=4, batch=1)
    assert torch.allclose(one["kl"][0], s["kl"][4], rtol=1e-3, atol=1e-6)
    assert torch.allclose(one["states"][0], s["states"][4], atol=1e-5)
    # no answer: the first answer token's distributions alone, the same as the answer's first position
    first = sensitivity(mm, prompts, answer_tokens=0, batch=5)
    assert torch.allclose(first["entropy"], s["entropy_first"], rtol=1e-4, atol=1e-6)
    assert torch.equal(first["kl"][:, 0], torch.zeros(12)) and (first["kl"][:, 1] > 0).all()
    # the only adapter that moves anything is the one labelled wherever any prompt is labelled
    labels = label_prompts(s["kl"] + torch.tensor([1e-3, 0.0]), z_min=0.5, margin=0.0)
    assert set(labels.tolist()) <= {-1, 1} and (labels == 1).any()


@torch.no_grad()
def test_pool_is_reproducible_deduplicated_and_never_holds_an_excluded_item(tmp_path):
    mm = _bundle(tmp_path)
    a = sample_pool(mm, 30, seed=5, batch=16, max_new_tokens=6, max_rounds=6)
    b = sample_pool(mm, 30, seed=5, batch=16, max_new_tokens=6, max_rounds=6)
    assert a == b and len(a) >= 3
    assert len({" ".join(p.lower().split()) for p in a}) == len(a)
    excluded = {a[0], a[2].upper()}  # folded case and spaces still match
    c = sample_pool(mm, 30, seed=5, batch=16, max_new_tokens=6, max_rounds=6, exclude=excluded)
    assert a[0] not in c and a[2] not in c and c[: len(a) - 2] == [p for p in a if p not in (a[0], a[2])]
    with pytest.raises(MoLoRAError, match="sample_pool"):
        sample_pool(mm, 0, seed=0)


def test_gates_from_labels_fit_each_labelled_adapter_against_the_unclaimed_prompts():
    g = torch.Generator().manual_seed(1)
    D = 8
    centers = torch.eye(D)[:3] * 4
    states, labels = [], []
    for i in range(60):
        k = i % 3 - 1  # -1 (unclaimed), 0, 1
        states.append(centers[k + 1] + torch.randn(5, D, generator=g) * 0.5)
        labels.append(k)
    lab = torch.tensor(labels)
    gates = gates_from_labels(states, lab, ["a", "b", "c"], min_prompts=5)
    assert list(gates) == ["a", "b"]  # "c" has no prompt: no gate, its prompts would stay on base
    router = GateRouter(GateConfig(hidden_size=D), gates)
    assert int(router.votes(centers[1][None])[0]) == 0 and int(router.votes(centers[2][None])[0]) == 1
    assert int(router.votes(centers[0][None])[0]) == -1
    with pytest.raises(MoLoRAError, match="no negatives"):
        gates_from_labels(states, torch.zeros(60, dtype=torch.long), ["a"])
    with pytest.raises(MoLoRAError, match="labels"):
        gates_from_labels(states[:3], lab, ["a"])


def test_confidence_chooser_sends_a_prompt_to_the_adapter_unusually_sure_of_itself_or_to_base(tmp_path):
    from molora.routing.confidence import ConfidenceChooser

    g = torch.Generator().manual_seed(2)
    pool = torch.stack([torch.rand(50, generator=g) + 0.5, torch.rand(50, generator=g) * 0.1 + 3.0], 1)  # [N, 2]
    ch = ConfidenceChooser.from_pool(["a", "b"], pool, z_min=2.0, margin=0.5)
    # prompt 0: b far surer than usual (entropy 1.0 against its 3.0-3.1), a as usual; prompt 1: both as usual;
    # prompt 2: a far surer than usual (0.2 against 0.5-1.5), b as usual
    ent = torch.tensor([[1.0, 1.0], [1.0, 3.05], [0.2, 3.05]])
    assert ch.decide(ent) == [1, -1, 0]
    assert ConfidenceChooser.from_pool(["a", "b"], pool, z_min=1e4, margin=0.0).decide(ent) == [-1, -1, -1]
    back = ConfidenceChooser.load(ch.save(tmp_path / "c"))
    assert back == ch
    with pytest.raises(molora.errors.BundleError, match="cannot read"):
        ConfidenceChooser.load(tmp_path / "missing")
    with pytest.raises(molora.errors.RoutingError, match="pool entropies"):
        ConfidenceChooser.from_pool(["a"], pool, z_min=1.0, margin=0.0)


@torch.no_grad()
def test_confidence_entropy_matches_the_pool_labelling_and_the_evaluation_asks_the_chooser(tmp_path):
    from molora.eval.runner import sequence_choice
    from molora.routing.confidence import ConfidenceChooser, first_token_entropy

    mm = _bundle(tmp_path)
    prompts = [" ".join(f"w{5 + (11 * k + j) % 100}" for j in range(2 + k % 5)) for k in range(9)]
    s = sensitivity(mm, prompts, answer_tokens=0, batch=4)
    rows = [mm.tokenizer(TEMPLATE.replace("{prompt}", p), add_special_tokens=False)["input_ids"] for p in prompts]
    ent = first_token_entropy(mm, rows, batch=3)
    assert torch.allclose(ent, s["entropy_first"], rtol=1e-4, atol=1e-6)
    some = first_token_entropy(mm, rows, batch=3, adapters=[1, -1])  # chosen adapters, -1: the base model
    assert torch.allclose(some[:, 0], ent[:, 1], rtol=1e-5) and not torch.allclose(some[:, 1], ent[:, 1])
    ch = ConfidenceChooser.from_pool(mm.adapter_names, ent, z_min=0.5, margin=0.0)
    picks = ch.choose_per_request(mm, prompts)
    assert picks == [None if d < 0 else mm.adapter_names[d] for d in ch.decide(ent)]
    assert set(picks) != {None}  # something is routed: the comparison below can tell
    mm.router = ch
    assert sequence_choice(mm, prompts) == picks


def test_hybrid_rule_lets_arrow_decide_whether_and_confidence_which():
    from molora.routing.hybrid import hybrid_decide

    share = torch.tensor([0.0, 0.3, 0.1, 0.5])
    z = torch.tensor([[5.0, 0.0], [0.0, 1.0], [0.5, 4.0], [-1.0, -2.0]])
    assert hybrid_decide(share, z, 0.2, None, None) == [-1, 1, -1, 0]  # claimed prompts only, largest z
    assert hybrid_decide(share, z, 0.2, 3.5, None) == [0, 1, 1, 0]  # a sure adapter also claims a prompt
    assert hybrid_decide(share, z, 0.2, None, 0.5) == [-1, 1, -1, -1]  # a claimed prompt no adapter is sure of
    assert hybrid_decide(torch.zeros(2), z[:2], 0.0, None, None) == [-1, -1]  # nothing claimed: base
    with pytest.raises(MoLoRAError, match="shares"):
        hybrid_decide(share[:3], z, 0.2, None, None)


@torch.no_grad()
def test_hybrid_chooser_shares_match_arrows_own_vote_and_the_evaluation_asks_it(tmp_path):
    from molora.eval.runner import sequence_choice
    from molora.routing.arrow import ArrowConfig
    from molora.routing.confidence import ConfidenceChooser, first_token_entropy
    from molora.routing.hybrid import HybridChooser, arrow_claim_share

    mm = _bundle(tmp_path)
    g = torch.Generator().manual_seed(3)
    calib = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (8,), generator=g)]
    prompts = [" ".join(f"w{5 + (7 * k + 3 * j) % 100}" for j in range(3 + k % 6)) for k in range(10)]
    rows = [mm.tokenizer(TEMPLATE.replace("{prompt}", p), add_special_tokens=False)["input_ids"] for p in prompts]
    ent = first_token_entropy(mm, rows, batch=4)
    conf = ConfidenceChooser.from_pool(mm.adapter_names, ent, z_min=0.0, margin=0.0)
    cfg = dict(granularity="per_block", prompt=True, rms_threshold=1.0, source_block=-1, prompt_window=4)
    h = HybridChooser(conf, ArrowConfig(**cfg, prompt_share=0.5)).bind(mm, calib)
    router = h._router(mm)
    share = arrow_claim_share(router, mm, rows, batch=3)
    for row, s in zip(rows, share):  # the share of the last 4 tokens whose calibrated Arrow decision is an adapter
        ids = torch.tensor([row])
        out = mm(ids, adapter_ids=torch.full_like(ids, -1), output_hidden_states=True, use_cache=False)
        b = router.carry_source
        picks, _ = router.choose(router._block_norm[b](out.hidden_states[b][0]), router._block_linear[b])
        assert float(s) == pytest.approx(float((picks[-4:, 0] >= 0).float().mean()))
    assert 0 < float(share.min()) < 0.5 <= float(share.max())  # some prompts claimed, some not: the test can tell
    picks = h.choose_per_request(mm, prompts)
    top = conf.zscores(ent).argmax(1)
    want = [mm.adapter_names[int(k)] if float(s) >= 0.5 else None for s, k in zip(share, top)]
    assert picks == want and set(want) - {None}
    mm.router = h
    assert sequence_choice(mm, prompts) == picks
    back = HybridChooser.load(h.save(tmp_path / "h"))
    assert back == h and back.bind(mm, calib).choose_per_request(mm, prompts) == picks
    with pytest.raises(MoLoRAError, match="prompt=true"):
        HybridChooser(conf, ArrowConfig(granularity="per_block", rms_threshold=1.0))
