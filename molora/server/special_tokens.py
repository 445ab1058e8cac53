"""Special tokens typed by a client are text: a chat message cannot close its turn and open one of its own.

A chat template writes the structure of a conversation with special tokens (`<|im_start|>`, `<|im_end|>`); a
message's content is text. Tokenizing the rendered prompt as one string would read a `<|im_end|>` that a user
typed as the special token, so a user could end their turn and write a system or assistant turn. Here every
special-token literal inside a client's strings is swapped for a marker before the template runs (`Shield.hide`:
a per-request random nonce the client cannot guess), and the rendered text is tokenized piece by piece
(`Shield.encode`): the template's own text with special tokens read as such, each marker as the literal's text
(`split_special_tokens`, as a tokenizer given that option reads it). A conversation with no special literal in its
strings is tokenized exactly as before, in one call.

The completions endpoint keeps special tokens (clients send templated prompts there). A server may allow them in
chat too (`molora serve --allow-special-tokens-in-chat`).

Knows tokenizers and strings; nothing of requests or HTTP.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

__all__ = ["Shield", "special_literals"]


def special_literals(tok: Any) -> tuple[str, ...]:
    """The text of every special token of `tok` (added tokens marked special, and the named special tokens),
    longest first so that a literal that contains another is matched whole."""
    found = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    found |= set(getattr(tok, "all_special_tokens", ()) or ())
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))


class Shield:
    """One request's markers: `hide` the special literals in client strings, `encode` the rendered prompt."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        literals = special_literals(tok)
        self._find = re.compile("|".join(re.escape(s) for s in literals)) if literals else None
        self._nonce = "mlrsp" + secrets.token_hex(8)
        self._marker = re.compile(self._nonce + r"x(\d+)x")
        self.hidden: list[str] = []  # marker k stands for hidden[k]

    def hide(self, value: Any) -> Any:
        """`value` (a string, or lists and dicts of them: a conversation, tool schemas) with each special literal
        inside its strings swapped for a marker; dict keys are left as they are."""
        if self._find is None:
            return value
        if isinstance(value, str):
            return self._find.sub(self._mark, value)
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {k: self.hide(v) for k, v in value.items()}
        return value

    def _mark(self, m: re.Match) -> str:
        self.hidden.append(m.group(0))
        return f"{self._nonce}x{len(self.hidden) - 1}x"

    def encode(self, text: str) -> list[int]:
        """Token ids of the rendered `text`: special tokens where the template wrote them, each hidden literal as
        text. Without hidden literals, one plain `encode` (the ids every request had before)."""
        if not self.hidden:
            return list(self.tok.encode(text, add_special_tokens=False))
        ids: list[int] = []
        at = 0
        for m in self._marker.finditer(text):
            if m.start() > at:
                ids += self.tok.encode(text[at : m.start()], add_special_tokens=False)
            ids += self.tok.encode(self.hidden[int(m.group(1))], add_special_tokens=False, split_special_tokens=True)
            at = m.end()
        if at < len(text):
            ids += self.tok.encode(text[at:], add_special_tokens=False)
        return ids
