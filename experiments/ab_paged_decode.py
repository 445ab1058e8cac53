"""A/B of the paged decode attention kernel: this tree's build against the one at a git revision, in one process.

    python -m experiments.ab_paged_decode [--rev d32c869] [--batch 32] [--ctx 160 1000] [--layers 30] [--repeats 12]

Builds the kernels of `molora/ops/csrc` as they were at REV (one fused_lora.cpp up to the split into one file per
kernel family, the folder's sources after) under another extension name (about a minute, once),
then times `paged_decode_rows` of both builds alternating (order swapped every repetition) over `--layers`
separate caches, as an engine step meets them (cold), at SmolLM2-135M's attention shape (9 query heads, 3 kv
heads, head dim 64, blocks of 16 scattered at random). Prints one line per dtype and context length: the medians
per layer call, their ratio, and whether the two outputs are equal bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def build_at(rev: str):
    """The kernels as they were at `rev`, built under another extension name. BoundBlock, which this process's own
    build registers too, is renamed (from v27 the sources carry their own bindings)."""
    from torch.utils.cpp_extension import load, load_inline

    flags = dict(extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"])
    files = _git("ls-tree", "--name-only", f"{rev}:molora/ops/csrc").split()
    if files == ["fused_lora.cpp"]:  # one file, up to the split
        source = _git("show", f"{rev}:molora/ops/csrc/fused_lora.cpp")
        binds = "PYBIND11_MODULE" in source
        return load_inline(
            name=f"molora_ab_paged_{rev}",
            cpp_sources=source.replace("BoundBlock", "BoundBlockAB"),
            functions=None if binds else ["paged_decode_rows"],
            **flags,
        )
    folder = Path(tempfile.mkdtemp(prefix=f"molora_ab_{rev}_"))  # one file per kernel family
    for name in files:
        (folder / name).write_text(_git("show", f"{rev}:molora/ops/csrc/{name}").replace("BoundBlock", "BoundBlockAB"))
    return load(
        name=f"molora_ab_paged_{rev}",
        sources=[str(folder / n) for n in files if n.endswith(".cpp")],
        extra_include_paths=[str(folder)],
        **flags,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="d32c869", help="git revision of the kernel to compare against")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, nargs="+", default=[160, 1000])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from molora.ops import kernel_build

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    old = build_at(a.rev)
    new = kernel_build.load()  # torch.ops.molora: the same entry points as torch ops
    if new is None:
        print(f"this tree's kernel did not build: {kernel_build.unavailable_reason()}", file=sys.stderr)
        return 2
    B, H, Hkv, hd, bs = a.batch, 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for ctxlen in a.ctx:
            nbk = -(-ctxlen // bs) + 1
            kcs = [torch.randn(B * nbk * bs, Hkv, hd, generator=g).to(dtype) for _ in range(a.layers)]
            vcs = [torch.randn(B * nbk * bs, Hkv, hd, generator=g).to(dtype) for _ in range(a.layers)]
            table = torch.randperm(B * nbk, generator=g).view(B, nbk).contiguous()
            ctx = torch.randint(max(1, ctxlen - 20), ctxlen, (B,), generator=g)
            q = torch.randn(B, H, hd, generator=g).to(dtype)
            rows = torch.arange(B)
            mods = {"old": old, "new": new}
            outs = {n: torch.empty_like(q) for n in mods}
            ts: dict[str, list[float]] = {n: [] for n in mods}
            with torch.no_grad():
                for i in range(a.repeats):
                    for name in ("old", "new") if i % 2 else ("new", "old"):
                        t0 = time.perf_counter()
                        for layer in range(a.layers):
                            mods[name].paged_decode_rows(
                                outs[name], q, kcs[layer], vcs[layer], table, ctx, rows, bs, hd**-0.5, 0
                            )
                        ts[name].append((time.perf_counter() - t0) / a.layers)
            mo, mn = (statistics.median(ts[n][2:]) * 1e6 for n in ("old", "new"))
            print(
                f"{str(dtype)[6:]} batch {B} ctx {ctxlen}: {a.rev} {mo:.0f} us, this tree {mn:.0f} us per layer "
                f"call ({mo / mn:.2f}x); equal bit for bit: {torch.equal(outs['old'], outs['new'])}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
