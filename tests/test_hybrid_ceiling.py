"""experiments/hybrid_ceiling.py: the rule family scored on given signals, the oracle's choice, AUC, and the rendered
reading of the data-free goal (within 10 points of the learned router)."""

from tests.conftest import load_script


def _sig() -> dict:
    """Two skills and four general prompts: skill a's items have high share, b's high z on b, general low both
    except one general prompt whose z on a is high (another adapter firing on general text)."""

    def d(share: float, za: float, zb: float) -> dict:
        return {"share": share, "z": {"A": za, "B": zb}}

    return {
        "skills": {
            "a": ("A", [d(0.5, 4.0, 0.0), d(0.3, 3.0, 0.0), d(0.05, 2.0, 0.0), d(0.0, 1.0, 0.0)]),
            "b": ("B", [d(0.0, 0.0, 5.0), d(0.0, 0.0, 4.5), d(0.0, 6.0, 1.5), d(0.1, 0.0, 2.0)]),
        },
        "general": [d(0.0, 0.0, 0.0), d(0.02, 0.5, 0.0), d(0.0, 5.0, 0.0), d(0.04, 0.0, 1.0)],
    }


def test_the_rule_sends_right_and_keeps_general_home():
    hc = load_script("hybrid_ceiling")
    r = hc.score(_sig(), 0.2, 4.5)
    # a: the two high-share items go, to A (top z) -> 50%; b: z 5.0 and 4.5 reach 4.5 on B -> 50%, the z 6.0 on A
    # goes to the wrong adapter; general: the z 5.0 prompt leaves -> 75% kept
    assert r["skills"] == {"a": 50.0, "b": 50.0} and r["general_kept"] == 75.0 and r["worst"] == 50.0
    assert hc.score(_sig(), 0.2, None)["skills"]["b"] == 0.0  # share alone never claims b's items
    assert hc.score(_sig(), 0.0, None)["general_kept"] == 50.0  # share 0 claims nothing: share > 0 required


def test_the_oracle_keeps_general_home_first():
    hc = load_script("hybrid_ceiling")
    b = hc.best(_sig())
    assert b["general_kept"] >= hc.GENERAL_KEPT
    # keeping every general prompt home forbids z_or <= 5.0 (a general prompt has z 5.0) and share <= 0.04; share
    # 0.05 then claims a's three items with a share and b's share-0.1 item (to B, its top z)
    assert (b["z_or"] is None or b["z_or"] > 5.0) and 0.04 < b["share"] <= 0.05
    assert b["skills"] == {"a": 75.0, "b": 25.0}


def test_auc_and_separation():
    hc = load_script("hybrid_ceiling")
    assert hc.auc([2.0, 3.0], [1.0]) == 1.0 and hc.auc([1.0], [2.0, 3.0]) == 0.0 and hc.auc([1.0], [1.0]) == 0.5
    s = hc.separation(_sig())
    assert s["a"]["share"] > s["b"]["share"]
    assert s["b"]["own_z"] == 1.0 and s["b"]["top_z"] < 1.0  # b's own z separates, the top z less (A fires)
    assert s["general_top_z_adapter"] == {"A": 3, "B": 1}


def test_the_section_reads_the_goal_off_the_test_oracle():
    hc = load_script("hybrid_ceiling")
    sig = _sig()
    split = {
        "n": 4,
        "n_general": 4,
        "served_rule": hc.score(sig, 0.2, 3.5),
        "oracle_rule": hc.best(sig),
        "val_oracle_rule": hc.best(sig),
        "auc_vs_general": hc.separation(sig),
    }
    rec = {
        "command": "python -m experiments.hybrid_ceiling",
        "date": "2026-12-04",
        "machine": {"cpu": "CPU", "threads": 1},
        "fingerprint": "f",
        "grid": {"share": [0.0, 1.0, 101], "z_or": 42, "general_kept_min": 95.0},
        "test_split": "test2",
        "learned_test_accuracy": {"a": 55.0, "b": 90.0},
        "splits": {"val": split, "test2": split},
    }
    text = "\n".join(hc.render_section(rec))
    assert "| test2 | learned router's accuracy | 55.0 | 90.0 | |" in text
    assert "leaves b -65.0 points against" in text  # a's +20 is not a shortfall
    assert "no threshold on these two signals meets" in text
    rec["learned_test_accuracy"] = {"a": 55.0, "b": 5.0}
    assert "is within 10 points of the learned router on every skill" in "\n".join(hc.render_section(rec))
