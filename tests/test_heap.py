"""molora.engine.heap: the start-up heap freeze and its knob."""

import gc

import pytest

from molora.engine.heap import freeze_enabled, freeze_heap, unfreeze_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_moves_live_objects_out_of_collections_and_unfreeze_brings_them_back(monkeypatch):
    monkeypatch.delenv("MOLORA_GC_FREEZE", raising=False)
    keep = [_Node() for _ in range(100)]
    try:
        n = freeze_heap()
        assert n == gc.get_freeze_count() and n >= len(keep)
        assert not any(o is keep[0] for o in gc.get_objects())  # frozen: in no generation
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    assert any(o is keep[0] for o in gc.get_objects())


def test_garbage_made_after_the_freeze_is_still_collected(monkeypatch):
    monkeypatch.delenv("MOLORA_GC_FREEZE", raising=False)
    try:
        freeze_heap()
        _Node()  # a cycle dropped at once
        assert gc.collect() >= 1
    finally:
        unfreeze_heap()


def test_knob_turns_it_off_and_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("MOLORA_GC_FREEZE", "0")
    assert not freeze_enabled() and freeze_heap() == 0 and gc.get_freeze_count() == 0
    monkeypatch.setenv("MOLORA_GC_FREEZE", "yes")
    with pytest.raises(ValueError, match="MOLORA_GC_FREEZE='yes'.*1 .*or 0"):
        freeze_heap()
    assert gc.get_freeze_count() == 0
