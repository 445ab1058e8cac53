"""The served hybrid chooser's calibration: what `molora serve ... --router hybrid` computes from the user's base model
and adapters at start-up, cached on disk so that a restart reads it back (the data-free path).

    chooser = hybrid_chooser(mm, settings)     # a bound molora.routing.hybrid.HybridChooser; settings: HybridSettings

Nothing labelled is read, only the adapters' weights and text the base model writes itself:

- **The pool** (`sample_pool`): user turns the base model writes after its own chat template's user header, at a
  temperature; a turn that does not end within the token budget is cut after its last sentence or line end
  (dropped without one); empty turns and repeats (case and whitespace folded) are dropped, and so is any turn in
  `exclude` (the experiments pass their evaluation items).
- **Per adapter**: the entropy of its first answer token on every pooled prompt (molora.routing.confidence:
  `first_token_entropy`); the chooser z-scores an adapter's confidence by their mean and spread
  (`ConfidenceChooser.from_pool`).
- **Arrow's prompt vote**: prototypes from the adapters' weights (computed at every start, a second) and the
  general-text calibration (`ArrowRouter.calibrate`: the base model reads general prompts; cached).

Cache (`$MOLORA_HYBRID_CACHE`, default `$MOLORA_CACHE/hybrid`): `pool-<key>.json` keyed by the base (its config and
a fingerprint of its weights: every parameter's, and a quantized linear's weight buffers', name, shape, dtype and a
strided sample of 4096 of its values; the adapters live in the bank's buffers and are left out), the prompt
template, the end-of-turn text, the weights' dtype and the pool settings; `entropy-<key>-<adapter>.json` per
adapter, keyed by the pool's key and the adapter's contents as loaded (every module's A, B and scale);
`arrow-<key>.pt`, keyed by the base, the template, the dtype and Arrow's settings. A restart reads all three; a
changed adapter recomputes its own entropies only; a changed base or setting recomputes everything. A cache file
that does not parse is recomputed (logged); one that cannot be written is logged and start-up goes on.

Run time (`HybridCalibration`, kept as `mm.calibration`): when an adapter is loaded or unloaded while serving, the
engine rebuilds the chooser for the new set of adapters (`rebuild_stages`, molora.engine.runtime_adapters): the pool
and Arrow's calibration are kept in memory, the other adapters keep their statistics and prototypes, and only a new
adapter's entropies are read from the cache (keyed by its contents) or computed, one batch of the pool per stage so
that a server runs one between two engine steps.

Knows models, adapters and the routing layer's choosers; nothing of engines, requests or HTTP.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.errors import BundleError, MoLoRAError
from molora.routing.base import SequenceRouter
from molora.routing.confidence import ConfidenceChooser, first_token_entropy
from molora.routing.hybrid import HybridChooser, HybridSettings, drain

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

log = logging.getLogger("molora.calibration")

CACHE_FORMAT = 1  # bump when what a cache file holds or how it is computed changes
ENTROPY_BATCH = 16  # prompts per forward of the pool's entropies (left padding: part of the key)


def cache_dir() -> Path:
    """$MOLORA_HYBRID_CACHE, else $MOLORA_CACHE/hybrid (default ~/.cache/molora/hybrid)."""
    if os.environ.get("MOLORA_HYBRID_CACHE"):
        return Path(os.environ["MOLORA_HYBRID_CACHE"])
    return Path(os.environ.get("MOLORA_CACHE", Path.home() / ".cache" / "molora")) / "hybrid"


# ------------------------------------------------------------------------------------------------ pool
def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def template_parts(mm: MoLoRAModel) -> tuple[str, str, list[int]]:
    """(text before "{prompt}", text after it, the end-of-turn token ids) of mm's bundle template."""
    from molora.manifest import CHATML_TEMPLATE, END_OF_TURN

    bundle = getattr(mm, "bundle", None)  # as molora.eval.runner.template_of: ChatML without a bundle
    template = bundle.prompt_template if bundle is not None else CHATML_TEMPLATE
    end = bundle.stop[0] if bundle is not None and bundle.stop else END_OF_TURN
    if "{prompt}" not in template:
        raise MoLoRAError(f"the prompt template {template!r} has no {{prompt}}")
    head, tail = template.split("{prompt}", 1)
    end_ids = list(mm.tokenizer(end, add_special_tokens=False)["input_ids"])
    if len(end_ids) != 1:
        raise MoLoRAError(f"the end-of-turn text {end!r} is {len(end_ids)} tokens; sampling needs it as one token")
    return head, tail, end_ids


@torch.no_grad()
def sample_pool(
    mm: MoLoRAModel,
    n: int,
    *,
    seed: int,
    exclude: Collection[str] = (),
    batch: int = 64,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    max_rounds: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Up to `n` distinct user turns the base model writes (module docstring), in the order drawn. Rounds of
    `batch` samples (generator seeded with seed + round) stop at n prompts or after `max_rounds` (default: 4 n /
    batch + 4); no prompt equal to one in `exclude` (case and whitespace folded) is kept. progress(kept, round)
    after every round. The first m of a pool of n are the pool of m drawn with the same settings."""
    if n < 1 or batch < 1 or max_new_tokens < 1 or temperature <= 0:
        raise MoLoRAError(
            f"sample_pool: n={n}, batch={batch}, max_new_tokens={max_new_tokens}, temperature={temperature}"
        )
    head, _, end_ids = template_parts(mm)
    head_ids = list(mm.tokenizer(head, add_special_tokens=False)["input_ids"])
    banned = {_fold(e) for e in exclude}
    seen: set[str] = set()
    out: list[str] = []
    rounds = max_rounds if max_rounds is not None else 4 * n // batch + 4
    for r in range(rounds):
        x = torch.tensor([head_ids] * batch, device=mm.device)
        toks = mm.generate(
            x,
            adapter_ids=SequenceRouter(None),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_id=end_ids,
            seed=seed + r,
        )[:, len(head_ids) :].tolist()
        for row in toks:
            if end_ids[0] in row:
                text = mm.tokenizer.decode(row[: row.index(end_ids[0])], skip_special_tokens=True).strip()
            else:  # the turn did not end within the budget: keep it up to its last sentence or line end
                text = mm.tokenizer.decode(row, skip_special_tokens=True)
                cut = max(text.rfind(c) for c in ".?!\n")
                text = text[: cut + 1].strip() if cut > 0 else ""
            key = _fold(text)
            if not key or key in seen or key in banned:
                continue
            seen.add(key)
            out.append(text)
            if len(out) == n:
                break
        if progress is not None:
            progress(len(out), r + 1)
        if len(out) == n:
            return out
    return out


# ------------------------------------------------------------------------------------------------ keys
def _digest(h: Any, t: torch.Tensor) -> None:
    t = t.detach().reshape(-1)
    step = max(1, t.numel() // 4096)
    h.update(t[::step].float().cpu().numpy().tobytes())


# config keys that say where a model was loaded from (a GGUF's folder the first time, the dequantized copy's after)
WHERE_KEYS = ("_name_or_path", "_commit_hash")


def base_fingerprint(mm: MoLoRAModel) -> str:
    """A key of the base model's weights (module docstring: config, and per parameter, and per buffer of a quantized
    linear, its name, shape, dtype and a strided sample of its values); the adapters, in the bank's buffers, are not
    in it."""
    from molora.model.quant_linear import QuantizedLinear

    config = json.loads(mm.config.to_json_string(use_diff=False))
    for where in WHERE_KEYS:  # where the weights were read from, not what they are
        config.pop(where, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    quantized = [
        (f"{m_name}.{b_name}", b)
        for m_name, m in mm.model.named_modules()
        if isinstance(m, QuantizedLinear)
        for b_name, b in m.named_buffers(recurse=False)
    ]
    for name, p in [*mm.model.named_parameters(), *quantized]:
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        _digest(h, p)
    return h.hexdigest()[:20]


def adapter_fingerprint(adapter: Any) -> str:
    """A key of one loaded adapter's contents: every module's path, A, B (all their values) and scale."""
    h = hashlib.sha256()
    for path in sorted(adapter.modules):
        m = adapter.modules[path]
        h.update(f"{path}:{tuple(m.A.shape)}:{tuple(m.B.shape)}:{m.scale!r}".encode())
        for t in (m.A, m.B):
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _read(path: Path) -> Any:
    """A cache file's JSON, None when absent or unreadable (logged: it is recomputed)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("hybrid: cache file %s is unreadable (%s); computing it again", path, e)
        return None


def _write(path: Path, obj: Any) -> None:
    """Write atomically (a temp file renamed); a failure is logged, not raised (serving goes on uncached)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("hybrid: cannot write the cache file %s (%s); the next start computes it again", path, e)


# ------------------------------------------------------------------------------------------------ chooser
def hybrid_chooser(mm: MoLoRAModel, settings: HybridSettings, folder: Path | None = None) -> HybridChooser:
    """The hybrid chooser for mm's adapters (all of them, in mm.adapter_names order), calibrated from the cache in
    `folder` (default `cache_dir()`) or computed and cached (module docstring), bound to mm. BundleError naming the
    cause and the fix when it cannot be built. `hybrid_calibration` also keeps what rebuilds it."""
    return hybrid_calibration(mm, settings, folder)[0]


def hybrid_calibration(
    mm: MoLoRAModel, settings: HybridSettings, folder: Path | None = None
) -> tuple[HybridChooser, HybridCalibration]:
    """(`hybrid_chooser`'s chooser, the `HybridCalibration` that rebuilds it when adapters change at run time)."""
    names = list(mm.adapter_names)
    if not names:
        raise BundleError("--router hybrid chooses among adapters and none are loaded; give --lora-modules NAME=PATH")
    folder = cache_dir() if folder is None else Path(folder)
    t0 = time.perf_counter()
    try:
        pool, pool_key = _pool(mm, settings, folder)
        head, tail, _ = template_parts(mm)
        rows = [list(mm.tokenizer(head + p + tail, add_special_tokens=False)["input_ids"]) for p in pool]
        cal = HybridCalibration(settings, folder, pool, pool_key, rows)
        ent = torch.stack([drain(cal.entropy_stages(mm, name)) for name in names], 1)  # [N, K]
        chooser = ConfidenceChooser.from_pool(names, ent, z_min=0.0, margin=0.0)  # z_min, margin: unused here
        # joint=False: what a chooser outside an engine runs (separate passes: the base model's, then one per
        # adapter). A served choice runs in the engine instead (molora.engine.choosing, `decide_stages`' busy): with
        # other requests running or waiting it runs one pass between two engine steps, so a choice pauses them for
        # one pass (docs/hybrid_stall.json); with none, the passes left run as one forward (0.71x the time, the
        # same picks on the 300 validation prompts: docs/hybrid_pool_size_choice.json, joint_pass_check)
        hybrid = HybridChooser(chooser, settings.arrow, settings.z_or, settings.z_floor, joint=False)
        _bind_arrow(hybrid, mm, settings, folder)
    except (MoLoRAError, RuntimeError, ValueError) as e:
        raise BundleError(
            f"the hybrid chooser cannot calibrate for adapters {names} ({type(e).__name__}: {e}); serve them "
            "with --router arrow or none, or fix the cause (cache folder: "
            f"{folder}, set $MOLORA_HYBRID_CACHE to move it)"
        ) from e
    log.info("hybrid chooser ready for %s in %.1f s (pool of %d prompts)", names, time.perf_counter() - t0, len(pool))
    return hybrid, cal


@dataclass
class HybridCalibration:
    """What a served hybrid chooser is calibrated from, kept so that it can be rebuilt when adapters are loaded or
    unloaded at run time (molora.engine.runtime_adapters): the settings, the cache folder, the pool (its prompts and
    their token ids, template applied) and its key, and each adapter's entropies over the pool by the adapter's
    contents (`adapter_fingerprint`; in memory here and on disk in `folder`)."""

    settings: HybridSettings
    folder: Path
    pool: list[str]
    pool_key: str
    rows: list[list[int]]
    entropies: dict[str, torch.Tensor] = field(default_factory=dict)  # adapter_fingerprint -> [N]

    def entropy_stages(self, mm: MoLoRAModel, name: str) -> Generator[None, None, torch.Tensor]:
        """[N]: adapter `name`'s first-answer-token entropy on every pooled prompt, from memory or the cache (keyed
        by its contents), else computed one batch of ENTROPY_BATCH prompts per stage (a yield before each: a server
        runs one between two engine steps). `name` must stay resident in mm throughout (the caller pins it)."""
        fingerprint = adapter_fingerprint(mm.adapters[name])
        if fingerprint in self.entropies:
            return self.entropies[fingerprint]
        key = _key(["entropy", CACHE_FORMAT, self.pool_key, fingerprint, ENTROPY_BATCH])
        path = self.folder / f"entropy-{self.pool_key}-{key}.json"
        cached = _read(path)
        n = len(self.rows)
        if isinstance(cached, dict) and isinstance(cached.get("entropy"), list) and len(cached["entropy"]) == n:
            log.info("hybrid: %s's entropies over the pool read from %s", name, path)
            ent = torch.tensor(cached["entropy"], dtype=torch.float64)
        else:
            t0, parts = time.perf_counter(), []
            for i in range(0, n, ENTROPY_BATCH):  # the same left-padded batches as one call over all the rows
                yield None
                k = mm.adapter_names.index(name)  # looked up again: the slots may change between stages
                chunk = self.rows[i : i + ENTROPY_BATCH]
                parts.append(first_token_entropy(mm, chunk, batch=ENTROPY_BATCH, adapters=[k])[:, 0].double())
            ent = torch.cat(parts)
            if not torch.isfinite(ent).all():
                raise MoLoRAError(f"adapter {name!r} gives non-finite entropies on the pool (are its weights finite?)")
            seconds = time.perf_counter() - t0
            log.info("hybrid: %s's entropies over %d pooled prompts computed in %.1f s", name, n, seconds)
            _write(path, {"adapter": name, "entropy": ent.tolist(), "seconds": round(seconds, 1)})
        self.entropies[fingerprint] = ent
        return ent

    def rebuild_stages(
        self, mm: MoLoRAModel, current: HybridChooser, names: Sequence[str], fresh: Sequence[str] = ()
    ) -> Generator[None, None, HybridChooser]:
        """A new chooser over `names` (in that order) with `current`'s rule, built aside (`current` is not touched):
        an adapter of `current` not in `fresh` keeps its statistics and Arrow prototypes, any other is calibrated
        now (`entropy_stages`; it must be resident in mm until the end). MoLoRAError for an adapter the chooser
        cannot score (non-finite entropies); the model's own errors (RuntimeError, ...) pass through."""
        if not names:
            raise MoLoRAError("a hybrid chooser needs at least one adapter to choose among")
        old = current.chooser
        mean, std = [], []
        for name in names:
            if name in old.adapter_names and name not in fresh:
                i = old.adapter_names.index(name)
                mean.append(old.mean[i])
                std.append(old.std[i])
                continue
            ent = yield from self.entropy_stages(mm, name)
            one = ConfidenceChooser.from_pool([name], ent[:, None], z_min=old.z_min, margin=old.margin)
            mean.append(one.mean[0])
            std.append(one.std[0])
        chooser = ConfidenceChooser(tuple(names), tuple(mean), tuple(std), old.z_min, old.margin)
        return current.rebuilt(mm, chooser, fresh=[n for n in names if n not in old.adapter_names or n in fresh])


def _bind_arrow(hybrid: HybridChooser, mm: MoLoRAModel, s: HybridSettings, folder: Path) -> None:
    """Bind the hybrid's Arrow, its general-text calibration (`ArrowRouter.calibrate`, adapter-free) read from the
    cache or measured and cached, keyed by the base, the template, the dtype and Arrow's settings."""
    from dataclasses import asdict

    head, tail, _ = template_parts(mm)
    dtype = str(next(mm.model.parameters()).dtype)
    key = _key(["arrow", CACHE_FORMAT, base_fingerprint(mm), head, tail, dtype, asdict(s.arrow)])
    path = folder / f"arrow-{key}.pt"
    state = None
    if path.is_file():
        try:
            state = torch.load(path, weights_only=True)
            log.info("hybrid: Arrow's general-text calibration read from %s", path)
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("hybrid: cache file %s is unreadable (%s); computing it again", path, e)
    t0 = time.perf_counter()
    hybrid.bind(mm, arrow_state=state)
    if state is None:
        log.info("hybrid: Arrow's general-text calibration computed in %.1f s", time.perf_counter() - t0)
        buf = io.BytesIO()
        torch.save(hybrid._router(mm).calibration_state(), buf)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(buf.getvalue())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("hybrid: cannot write the cache file %s (%s); the next start computes it again", path, e)


def _pool(mm: MoLoRAModel, s: HybridSettings, folder: Path) -> tuple[list[str], str]:
    head, tail, end_ids = template_parts(mm)
    dtype = str(next(mm.model.parameters()).dtype)
    knobs = [s.pool_n, s.pool_seed, s.pool_batch, s.pool_max_new_tokens, s.pool_temperature]
    key = _key(["pool", CACHE_FORMAT, base_fingerprint(mm), head, tail, end_ids, dtype, knobs])
    path = folder / f"pool-{key}.json"
    cached = _read(path)
    if isinstance(cached, dict) and isinstance(cached.get("prompts"), list) and len(cached["prompts"]) >= 2:
        log.info("hybrid: pool of %d prompts read from %s", len(cached["prompts"]), path)
        return [str(p) for p in cached["prompts"]], key
    t0 = time.perf_counter()
    log.info("hybrid: the base model writes its pool of %d user turns (once; cached in %s)", s.pool_n, folder)

    def progress(kept: int, rounds: int) -> None:
        log.info("hybrid: pool %d/%d prompts after %d rounds, %.0f s", kept, s.pool_n, rounds, time.perf_counter() - t0)

    pool = sample_pool(
        mm,
        s.pool_n,
        seed=s.pool_seed,
        batch=s.pool_batch,
        max_new_tokens=s.pool_max_new_tokens,
        temperature=s.pool_temperature,
        progress=progress,
    )
    if len(pool) < 2:
        raise MoLoRAError(
            f"the base model wrote only {len(pool)} distinct user turns; the pool needs at least 2 (does it end a "
            f"turn with the template's end-of-turn token {mm.tokenizer.decode(end_ids)!r}? give --chat-template)"
        )
    _write(path, {"prompts": pool, "seconds": round(time.perf_counter() - t0, 1), "settings": knobs})
    return pool, key
