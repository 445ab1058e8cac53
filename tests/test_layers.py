"""The layering of the README's "How it is built" table: imports point down only (checked by parsing every
module's imports), and the table names every package placed here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "molora"

LAYER = {  # module prefix -> layer (the longest matching prefix wins)
    "molora.errors": 0,
    "molora.config": 0,
    "molora.ops": 1,
    "molora.adapters.io": 1,
    "molora.data": 1,
    "molora.sampling": 1,
    "molora.view": 1,
    "molora.structured": 1,  # grammars (xgrammar) for the sampler's constraint mechanism
    "molora.schema_rules": 1,  # what a JSON schema means to the grammar engine (pure functions)
    "molora.adapters.bank": 2,
    "molora.adapters": 2,
    "molora.routing": 2,
    "molora.model": 3,
    "molora.bundle": 3,
    "molora.calibration": 3,  # the served hybrid chooser's pool and calibration (molora.bundle builds it)
    "molora.manifest": 3,  # the bundle manifest (molora.bundle re-exports it)
    "molora.prompts": 3,  # prompts through a loaded bundle model (molora.bundle re-exports it)
    "molora.engine": 4,
    "molora.server": 5,
    "molora.train": 5,
    "molora.eval": 5,
    "molora.bench": 5,
    "molora.multimodal": 5,  # an application over layers 0-5: its recipe trains through molora.train
    "molora.cli": 6,
    "molora": 6,
}
SIBLINGS_APART = ("molora.server", "molora.train", "molora.eval", "molora.bench")  # layer 5 must not mix


def layer_of(name: str) -> tuple[int, str]:
    best = max((p for p in LAYER if name == p or name.startswith(p + ".")), key=len)
    return LAYER[best], best


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("molora"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("molora")}
    return out


def test_imports_point_down_only():
    bad = []
    for path in ROOT.rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        if mod == "molora":
            continue  # the package front door re-exports lazily
        lm, pm = layer_of(mod)
        for imp in imports(path) - {"molora"}:  # the bare package is a lazy facade, not a layer
            li, pi = layer_of(imp)
            apart = pm in SIBLINGS_APART and pi in SIBLINGS_APART and pm != pi
            if li > lm or apart:
                bad.append(f"{mod} (layer {lm}) imports {imp} (layer {li})")
    assert not bad, "\n".join(sorted(bad))


def test_the_readme_layer_table_names_every_placed_package():
    """Every package this test places is in the README's "How it is built" table, in the row of its layer."""
    readme = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## How it is built") :]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| (\d) \| (.*?) \|", line)
        if m:
            for name in re.findall(r"`(molora[\w.]*)`", m.group(2)):
                rows[name] = int(m.group(1))
    wrong = {p: (layer, rows.get(p)) for p, layer in LAYER.items() if rows.get(p) != layer}
    assert not wrong, f"package: (layer here, layer in the README's table): {wrong}"
