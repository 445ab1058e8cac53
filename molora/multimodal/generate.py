"""Constrained generation on the early-fusion model: images as exact 64-code spans, captions as words.

    draw(mm, digits, spec)          "<bos> draw the digit d <boi>" -> 64 codes, <eoi>, a caption, <eos>
    caption_images(mm, images, spec) "<bos> <boi> c1..c64 <eoi>"    -> a caption, <eos>

A 2M-parameter model does not reliably emit exactly 64 codes, so every step restricts the logits to what its
span allows (as Emu3 and Lumina-mGPT do): inside an image only codes, after the 64th code only <eoi>, in
text only words and <eos>. `spec` picks the routing: None (the base model, no routing at all), an adapter
name (every token), a Router (e.g. the bundle's VocabRouter), or `EveryToken(names)` (several adapters
summed on every token). `passes=[names]` emulates per-token routing with one pass per adapter: every
forward runs once per adapter over the whole batch, and each run of positions keeps the pass its router
picks (its logits and its keys/values), which is what a server that routes per sequence has to do.

The spans are a `molora.sampling.SpanConstraint` applied through the sampler's one constraint mechanism (a
packed bitmask per row). Served, the same spans come from the bundle's manifest (`extra.constrained_spans`,
token names read from the tokenizer) and the engine applies them the same way; greedy answers equal `draw`'s
(tests/test_multimodal.py). The one difference: outside an image the served constraint forbids only codes and
<eoi>, where the demo's (`demo_spans`) allows only words and <eos>.

Images come back as levels (numpy [64], 0..15); `write_png` turns one into a PNG without extra packages.
This module knows the vocabulary and MoLoRAModel's forward; it knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from molora.errors import MoLoRAError, RoutingError
from molora.multimodal.vocab import BOI, EOI, PIXELS, WORDS, draw_prompt, image_span, image_token_ids
from molora.routing import Router, Routing
from molora.routing.base import adapter_index
from molora.sampling import SpanConstraint, apply_bitmask, constraint_bitmask, sample_next

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

CAPTION_TOKENS = 6  # the longest caption (5 words) and <eos>


class EveryToken(Router):
    """Every token on all of `names` at once, deltas summed (top-k routing with weight 1 each)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        idx = torch.tensor([adapter_index(adapter_names, n) for n in self.names], device=input_ids.device)
        ids = idx.expand(*input_ids.shape, len(self.names)).clone()  # [B, L, k]
        return Routing(ids, torch.ones(ids.shape, device=input_ids.device))


@dataclass(frozen=True)
class Drawn:
    """One generated sequence: the image levels [64] (None: no complete image) and the caption text."""

    tokens: list[int]
    image: np.ndarray | None
    caption: str


def demo_spans(tokenizer: Any) -> SpanConstraint:
    """The demo's spans: <boi>, exactly 64 codes, <eoi>; outside an image only the words and <eos>."""
    vocab = tokenizer.get_vocab()
    boi, codes = image_token_ids(tokenizer)
    return SpanConstraint(
        boi, vocab[EOI], tuple(codes), PIXELS, outside=tuple(vocab[w] for w in WORDS) + (vocab["<eos>"],)
    )


def _forward(
    mm: MoLoRAModel, spec: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, start: int
) -> torch.Tensor:
    """Last-position logits [B, V] of one forward; spec None runs the plain base model (no routing)."""
    if spec is None:
        out = mm.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
        )
    else:
        out = mm(
            ids,
            attention_mask=mask,
            adapter_ids=spec,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            start=start,
            logits_to_keep=1,
        )
    return out.logits[:, -1]


def _k_pass_forward(
    mm: MoLoRAModel,
    router: Router,
    passes: Sequence[str],
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    cache: Any,
    start: int,
) -> torch.Tensor:
    """The same forward as one routed pass, done with one pass per adapter: for each run of positions that
    the router gives one adapter, every adapter in `passes` runs over the run and all rows; the router's pick
    is run last and kept (logits and cache), the others are cropped from the cache."""
    routes = router.route(ids, mm.adapter_names, start=start).adapter_ids  # [B, n]
    if not bool((routes == routes[:1]).all()):
        raise RoutingError("the K-pass emulation needs rows whose routes agree per position (aligned prompts)")
    cols, n, i, logits = routes[0].tolist(), ids.shape[1], 0, None
    while i < n:
        j = i
        while j < n and cols[j] == cols[i]:
            j += 1
        keep = mm.adapter_names[cols[i]] if cols[i] >= 0 else None
        order = [p for p in passes if p != keep] + [keep]
        for name in order:
            sub_mask = mask[:, : mask.shape[1] - n + j]
            logits = _forward(mm, name, ids[:, i:j], sub_mask, pos[:, i:j], cache, start + i)
            if name is not keep:
                cache.crop(-(j - i))  # drop this pass's keys/values (a negative count removes that many)
        i = j
    return logits


@torch.no_grad()
def generate_constrained(
    mm: MoLoRAModel,
    prompts: Sequence[Sequence[int]],
    spec: Any = None,
    *,
    max_new: int,
    temperature: float = 0.0,
    seed: int | None = None,
    text_temperature: float | None = None,
    passes: Sequence[str] | None = None,
) -> list[list[int]]:
    """New token ids per prompt (left-padded batch; <eos> and what follows dropped), spans constrained.
    text_temperature (default: temperature) samples the text spans, temperature the image spans."""
    from transformers import DynamicCache

    from molora.bundle import left_pad

    if passes is not None and not isinstance(spec, Router):
        raise MoLoRAError("passes= emulates a router's routing: give the router as spec")
    sp = demo_spans(mm.tokenizer)
    vocab = mm.tokenizer.get_vocab()
    eos, pad = vocab["<eos>"], vocab["<pad>"]
    ids, mask = left_pad(prompts, pad, mm.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator(device=mm.device).manual_seed(seed) if seed is not None else None
    B = ids.shape[0]
    so_far = [list(p) for p in prompts]  # each row's ids (prompt + generated): the spans' state
    done = torch.zeros(B, dtype=torch.bool, device=mm.device)
    cache, step, start, out = DynamicCache(), ids, 0, []
    for _ in range(max_new):
        if passes is None:
            logits = _forward(mm, spec, step, mask, pos, cache, start)
        else:
            logits = _k_pass_forward(mm, spec, passes, step, mask, pos, cache, start)
        logits = apply_bitmask(logits.float(), constraint_bitmask([[sp]] * B, so_far, logits.shape[-1]))
        nxt = sample_next(logits, temperature, 0, 1.0, gen)
        if text_temperature is not None and text_temperature != temperature:  # rows in text take their own
            in_image = torch.tensor([sp.state(t) != 2 for t in so_far], device=mm.device)
            nxt = torch.where(in_image, nxt, sample_next(logits, text_temperature, 0, 1.0, gen))
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt)
        for row, t in zip(so_far, nxt.tolist()):
            row.append(t)
        done |= nxt == eos
        if bool(done.all()):
            break
        start += step.shape[1]
        step, pos = nxt[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
    rows = torch.stack(out, 1).tolist() if out else [[] for _ in range(B)]
    return [r[: r.index(eos)] if eos in r else r for r in rows]


def parse(tokenizer: Any, tokens: Sequence[int]) -> Drawn:
    """Split generated ids into the image (the codes up to <eoi>) and the caption after it."""
    eoi = tokenizer.get_vocab()[EOI]
    code_level = {t: q for q, t in enumerate(image_token_ids(tokenizer)[1])}
    tokens = list(tokens)
    image = None
    rest = tokens
    if eoi in tokens:
        cut = tokens.index(eoi)
        levels = [code_level[t] for t in tokens[:cut] if t in code_level]
        image = np.array(levels, dtype=np.int64) if len(levels) == PIXELS else None
        rest = tokens[cut + 1 :]
    return Drawn(tokens, image, tokenizer.decode(rest, skip_special_tokens=True).strip())


def encode(mm: MoLoRAModel, text: str) -> list[int]:
    return mm.tokenizer("<bos> " + text, add_special_tokens=False)["input_ids"]


def draw(
    mm: MoLoRAModel,
    digits: Sequence[int],
    spec: Any = None,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    text_temperature: float | None = None,
    passes: Sequence[str] | None = None,
) -> list[Drawn]:
    """An image and its caption per digit: "draw the digit d <boi>" continued under `spec`."""
    prompts = [encode(mm, f"{draw_prompt(int(d))} {BOI}") for d in digits]
    rows = generate_constrained(
        mm,
        prompts,
        spec,
        max_new=PIXELS + 1 + CAPTION_TOKENS,
        temperature=temperature,
        seed=seed,
        text_temperature=text_temperature,
        passes=passes,
    )
    return [parse(mm.tokenizer, r) for r in rows]


def caption_images(
    mm: MoLoRAModel,
    images: Sequence[np.ndarray],
    spec: Any = None,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[str]:
    """A caption per image (levels [64]): "<boi> codes <eoi>" continued under `spec`."""
    prompts = [encode(mm, image_span(im)) for im in images]
    rows = generate_constrained(mm, prompts, spec, max_new=CAPTION_TOKENS, temperature=temperature, seed=seed)
    return [mm.tokenizer.decode(r, skip_special_tokens=True).strip() for r in rows]


# --------------------------------------------------------------------------------------------- pictures

_CODE = re.compile(r"<img_(\d+)>")


def levels_from_text(text: str) -> np.ndarray:
    """The first image of a generated text ("... <boi> <img_3> <img_0> ... <eoi> ..."): levels [64]; a span
    of other length is cut or padded with 0 (an unconstrained sampler may not stop at 64)."""
    body = text.split(BOI, 1)[-1].split("<eoi>", 1)[0]
    levels = [min(int(q), 15) for q in _CODE.findall(body)]
    if not levels:
        raise MoLoRAError("no image codes (<img_0> .. <img_15>) in the text")
    return np.array((levels + [0] * PIXELS)[:PIXELS], dtype=np.int64)


def to_pixels(levels: np.ndarray, scale: int = 8) -> np.ndarray:
    """levels [64] (0..15) -> uint8 [8*scale, 8*scale], ink dark on white as the digits are drawn."""
    grey = (255 - np.asarray(levels, dtype=np.int64).reshape(8, 8) * 17).astype(np.uint8)
    return np.kron(grey, np.ones((scale, scale), dtype=np.uint8))


def write_png(pixels: np.ndarray, path: str | Path) -> Path:
    """An 8-bit greyscale PNG of pixels [H, W] (uint8); zlib only, no imaging package needed."""
    h, w = pixels.shape
    raw = b"".join(b"\x00" + pixels[r].astype(np.uint8).tobytes() for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    path = Path(path)
    try:
        path.write_bytes(png)
    except OSError as e:
        raise MoLoRAError(f"cannot write {path}: {e}") from e
    return path
