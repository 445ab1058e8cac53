"""`DecodeGraphs`: decode steps replayed from graphs captured over the fixed slot bank (CUDA graphs on a GPU).

    graphs = runner.enable_graphs()                     # on CUDA; elsewhere pass capture= (tests)
    out = runner.forward(tokens, positions, meta, routing, logits=rows)   # replayed where the step fits

A step fits (`accepts`) when every sequence decodes one token, there are at most max(buckets) of them, its fixed
routing (pinned, vocab-routed or base rows: `StepRouting.slot_ids` and `weights`) has top-k at most `max_top_k`,
and an in-network router, if any, is a `LearnedRouter` (per-block gates; its rows and allowed adapters may change
from step to step). Prefill chunks and per-linear routers (Arrow) run eagerly.

Each graph is keyed by (B_pad, nb, k, weighted, learned): B_pad the smallest bucket holding the step's B
sequences, nb the blocks of its longest context rounded up to a power of two (at most max_model_len /
block_size), k and whether weights are given, and for learned routing the router with whether the step carries
decisions and fixes some (None without; the router's config and gate tensors are part of the key, so a new
confidence or an added gate records anew). Its static buffers, written before every replay:

    tokens, positions   [B_pad]          the step's tokens (rows past B: token 0 at position 0)
    index               [B_pad * (2+nb)] one host-to-device copy per step, viewed as
                                         write_rows [B_pad] | ctx [B_pad] | table [B_pad, nb]
    slot_ids, weights   [B_pad, k]       the fixed routing (rows past B: -1, weight 0)
    learned routing:    router_slots [K] (with mix experts [K, m] and router_weights [K, m]: each router index's row;
                        the key holds the table's shape, not the mixes, so changing a mix expert's weights or adapters
                        replays the same graph), owned [B_pad] (the rows the router decides), allowed [B_pad, K]
                        (each row's allowed adapters: the step's groups spread over their rows on the device),
                        carry, fixed [B_pad] (-2 past B)

Padding rows write their K/V into the runner's scratch block (`ModelRunner.scratch_block`, owned by no sequence)
and attend over that one row, so they compute finite values that nobody reads. Outputs are the captured step's
tensors, copied out (rows < B) after each replay.

Nothing that can change between replays is a Python value inside the recorded step (the failure other servers
shipped: a segment count baked in at capture dropped LoRA deltas on later replays). Slot ids and weights are
tensors in the graph's buffers; the routed linears take no shortcut from `lora.active` and keep no cast from an
earlier call while recording (`molora.ops.device.recording`); the decode mask is computed inside the graph from `ctx`;
the dispatcher must not read slot ids back (`check_ids` not True; triton's plan is built on the device); the
bank's tensors never move (`molora.adapters.bank`), so adapters loaded, unloaded or rewritten between replays
are what the next replay reads. What a graph does hold fixed: the model's weights and the KV cache (do not
`.to()` the model after capture) and every shape.

Capture: `capture(step) -> (replay, out)` runs `step` (a no-argument function returning a `StepOutput`) and
returns a function that runs it again and the outputs it writes. `cuda_capture` warms up on a side stream (triton
compiles, cuBLAS allocates) and records into a CUDA graph in one memory pool shared by all graphs. A capture that
fails (an op that syncs, an unsupported kernel) is logged once and its key runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from molora.errors import MoLoRAError
from molora.model.batch import AttnPlan, Decode, RouterGroup, StepOutput, StepRouting
from molora.ops.device import recording, to_device
from molora.routing.learned import LearnedRouter

log = logging.getLogger("molora.graphs")

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)

Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def cuda_capture() -> Capture:
    """`capture` for CUDA graphs: warm up once on a side stream, then record one graph; every graph made by
    this capture shares one memory pool (replays run one at a time)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles triton kernels, sizes cuBLAS workspaces
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the server's other threads (a file read, a metrics scrape) neither break
        # the capture nor are recorded into it
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()
        return graph.replay, out

    return capture


Key = tuple[int, int, int, bool, Any]


@dataclass
class _Graph:
    replay: Callable[[], None]
    out: Any  # the StepOutput whose tensors each replay writes
    tokens: Tensor  # [B_pad]
    positions: Tensor  # [B_pad]
    index: Tensor  # [B_pad * (2 + nb)]: write_rows | ctx | table
    routing: Any  # the recorded StepRouting: slot_ids, weights; learned: router_slots, groups[0],
    #                              carry, fixed


class DecodeGraphs:
    """Captured decode steps of one `ModelRunner` (module docstring). Counters: `captures`, `replays`, and
    `failed` (keys whose capture failed and that run eagerly)."""

    def __init__(
        self,
        runner: Any,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_top_k: int = 1,
        max_graphs: int = 64,
        capture: Capture | None = None,
    ) -> None:
        if capture is None:
            if runner.device.type != "cuda":
                raise MoLoRAError(
                    f"decode graphs are captured on CUDA; the runner is on {runner.device.type} "
                    "(pass capture= to record steps another way)"
                )
            capture = cuda_capture()
        check = getattr(runner.mm.dispatcher, "check_ids", False)
        if check or (check is None and runner.device.type == "cpu"):
            raise MoLoRAError(
                "decode graphs need a dispatcher that does not read slot ids back each step "
                "(LoRADispatcher.check_ids=False on the CPU, not True anywhere)"
            )
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise MoLoRAError(f"buckets must be increasing batch sizes >= 1, got {list(buckets)}")
        self.runner, self.capture = runner, capture
        self.buckets, self.max_top_k, self.max_graphs = tuple(buckets), max_top_k, max_graphs
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.graphs: dict[Key, _Graph | None] = {}
        self.captures = self.replays = 0
        self.failed: list[Key] = []

    def accepts(self, meta: Any, routing: Any) -> bool:
        """Whether a step of this layout and routing can be replayed (module docstring)."""
        q = meta.query_lens
        if not q or len(q) > self.buckets[-1] or any(n != 1 for n in q):
            return False
        if routing is None:
            return True
        if routing.slot_ids is None or routing.slot_ids.shape[1] > self.max_top_k:
            return False
        router = routing.router
        return (
            router is None
            or not routing.groups
            or (isinstance(router, LearnedRouter) and router.config.top_k * _width(routing) <= self.max_top_k)
        )

    def key(self, meta: Any, routing: Any) -> Key:
        B = len(meta.query_lens)
        bp = next(b for b in self.buckets if b >= B)
        need = -(-max(meta.context_lens) // self.runner.block_size)
        nb = min(1 << (need - 1).bit_length(), self.max_blocks)
        k = 1 if routing is None else routing.slot_ids.shape[1]
        learned = None
        if routing is not None and routing.router is not None and routing.groups:
            router = routing.router  # its config and gate tensors are part of the recorded step: a new config
            # (e.g. another confidence) or a gate added (new parameters) is a new key, captured anew
            learned = (
                router,
                router.config,
                router.weight.data_ptr(),
                router.bias.data_ptr(),
                tuple(routing.router_slots.shape),  # (K,), or (K, m) with mix experts (StepRouting.router_weights)
                routing.carry is not None,
                routing.fixed is not None,
            )
        return bp, nb, k, routing is not None and routing.weights is not None, learned

    def run(self, tokens: Tensor, positions: Tensor, meta: Any, routing: Any, logits: bool | list[int]) -> Any:
        """The `StepOutput` of an accepted step, replayed (captured first if its key is new); None where this key
        cannot be captured (the caller runs the step eagerly)."""
        key = self.key(meta, routing)
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:
                return None
            self.graphs[key] = self._capture(key)
        g = self.graphs[key]
        if g is None:
            return None
        self._fill(g, key, tokens, positions, meta, routing)
        g.replay()
        self.replays += 1
        return self._outputs(g, len(meta.query_lens), routing, logits)

    # ------------------------------------------------------------------------------------ internals
    def _capture(self, key: Key) -> _Graph | None:
        bp, nb, k, weighted, learned = key
        r = self.runner
        dev, bs = r.device, r.block_size
        index = torch.empty(bp * (2 + nb), dtype=torch.long, device=dev)
        write_rows, ctx, table = index[:bp], index[bp : 2 * bp], index[2 * bp :].view(bp, nb)
        write_rows.fill_(r.scratch_block * bs)  # every row a padding row while recording
        ctx.fill_(1)
        table.fill_(r.scratch_block)
        tokens = torch.zeros(bp, dtype=torch.long, device=dev)
        positions = torch.zeros(bp, dtype=torch.long, device=dev)
        slot_ids = torch.full((bp, k), -1, dtype=torch.long, device=dev)
        weights = torch.zeros(bp, k, dtype=torch.float32, device=dev) if weighted else None
        rows = torch.arange(bp, device=dev)
        plan = AttnPlan(write_rows, rows, Decode(rows, table, ctx, bs, keep_mask=False), [])
        routing = StepRouting(slot_ids, weights)
        if learned is not None:
            router, _, _, _, K, carried, fixed = learned
            routing.router = router
            routing.router_slots = torch.full(K, -1, dtype=torch.long, device=dev)
            if len(K) == 2:  # mix experts: each index's slots and weights
                routing.router_weights = torch.zeros(K, dtype=torch.float32, device=dev)
            routing.groups = [
                RouterGroup(
                    None,
                    torch.ones(bp, K[0], dtype=torch.bool, device=dev),
                    torch.zeros(bp, dtype=torch.bool, device=dev),
                )
            ]
            routing.carry = torch.full((bp,), -2, dtype=torch.long, device=dev) if carried else None
            routing.fixed = torch.full((bp,), -2, dtype=torch.long, device=dev) if fixed else None

        def step() -> Any:
            return r.compute(tokens, positions, plan, routing, logits=True)

        try:
            with recording():
                replay, out = self.capture(step)
        except Exception as e:  # an op that syncs or cannot be recorded: this key runs eagerly
            log.warning(
                "decode graph %s could not be captured (%s: %s); that shape runs eagerly", key, type(e).__name__, e
            )
            self.failed.append(key)
            return None
        finally:
            r.context.clear()
        self.captures += 1
        log.info(
            "captured a decode graph for %d sequences, %d context blocks, top-%d%s",
            bp,
            nb,
            k,
            ", weighted" if weighted else "",
        )
        return _Graph(replay, out, tokens, positions, index, routing)

    def _fill(self, g: _Graph, key: Key, tokens: Tensor, positions: Tensor, meta: Any, routing: Any) -> None:
        bp, nb = key[0], key[1]
        r = self.runner
        bs, scratch = r.block_size, r.scratch_block
        B = len(meta.query_lens)
        write, ctx, table = [], [], []
        for c, tb in zip(meta.context_lens, meta.block_tables):
            write.append(tb[(c - 1) // bs] * bs + (c - 1) % bs)
            ctx.append(c)
            row = tb[:nb]
            table += row + [0] * (nb - len(row))
        pad = bp - B
        g.index.copy_(
            to_device(write + [scratch * bs] * pad + ctx + [1] * pad + table + [scratch] * (pad * nb), r.device),
            non_blocking=True,
        )
        rec = g.routing

        def put(buf: Tensor, value: Tensor | None, pad: float) -> None:  # rows < B from the step, the rest padding
            if value is None:
                buf.fill_(pad)
            else:
                buf[:B].copy_(value)
                buf[B:].fill_(pad)

        put(g.tokens, tokens, 0)
        put(g.positions, positions, 0)
        put(rec.slot_ids, None if routing is None else routing.slot_ids, -1)
        if rec.weights is not None:
            put(rec.weights, routing.weights, 0)
        if rec.router is not None:  # learned: which rows the router owns and what each may choose, on the device
            rec.router_slots.copy_(routing.router_slots)
            if rec.router_weights is not None:
                rec.router_weights.copy_(routing.router_weights)
            group = rec.groups[0]
            group.owned.zero_()
            group.allowed.fill_(True)
            for src in routing.groups:
                rows = slice(0, B) if src.rows is None else src.rows
                group.owned[rows] = True
                if src.allowed is not None:
                    group.allowed[rows] = src.allowed
            for name in ("carry", "fixed"):
                if getattr(rec, name) is not None:
                    put(getattr(rec, name), getattr(routing, name), -2)

    @staticmethod
    def _outputs(g: _Graph, B: int, routing: Any, logits: bool | list[int]) -> Any:
        o = g.out
        cut = lambda t: None if t is None else t[:B].clone()
        out = StepOutput(
            o.hidden[:B].clone(),
            None,
            None if routing is None else cut(o.last_slot_ids),
            None if routing is None else cut(o.last_weights),
            cut(o.last_carry),
            cut(o.carry_rows),
        )
        if logits is not False:
            out.logits = o.logits[:B].clone() if logits is True else o.logits[:B][logits]
        return out


def _width(routing: Any) -> int:
    """Columns per router choice: 1, or the expert table's width m with mix experts (StepRouting.router_weights)."""
    return 1 if routing.router_weights is None else int(routing.router_weights.shape[1])
