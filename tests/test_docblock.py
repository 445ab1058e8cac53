"""The one renderer of README/docs blocks (molora.docblock) that every make_* script uses."""

import pytest

from molora.docblock import markers, replace_block, wrap, write_block


def test_a_block_is_replaced_whole_and_the_rest_kept(tmp_path):
    begin, end = markers("x", "tools/x.py")
    assert begin == "<!-- x:begin (tools/x.py) -->" and end == "<!-- x:end -->"
    text = f"head\n{begin}\nold\n{end}\ntail {end}\n"
    assert replace_block(text, begin, end, wrap(begin, end, "new")) == f"head\n{begin}\nnew\n{end}\ntail {end}\n"
    page = tmp_path / "page.md"
    page.write_text(text)
    assert write_block(page, begin, end, wrap(begin, end, "new"), check=True) and page.read_text() == text
    assert write_block(page, begin, end, wrap(begin, end, "new"))
    assert not write_block(page, begin, end, wrap(begin, end, "new"))  # rendered again: nothing changes


def test_missing_markers_stop_the_script_and_a_block_must_carry_its_markers(tmp_path):
    begin, end = markers("x", "s.py")
    with pytest.raises(SystemExit, match="page.md has no"):
        replace_block("no markers here", begin, end, wrap(begin, end, "b"), tmp_path / "page.md")
    with pytest.raises(SystemExit):
        replace_block(f"{end} before {begin}", begin, end, wrap(begin, end, "b"))
    with pytest.raises(ValueError, match="must start with"):
        replace_block(f"{begin}{end}", begin, end, "body without markers")
