"""llama.cpp as a peer: the same token ids through molora's Engine and llama.cpp, alternating, at matching precisions.

    molora bench peer [--variants fp32 bf16 int8 int4] [--requests 16] [--prompt-len 64] [--new-tokens 32]
        [--repeats 3] [--threads 1] [--cache DIR] [--json OUT]
    molora bench engine --peer llama.cpp [same options]
    molora bench peer --speculative JSON [...]   prompt lookup on both sides, batch 1 (molora.bench.peer_speculative)

llama.cpp runs through `llama-cpp-python` (optional: `pip install 'molora[peer]'`, a source build of llama.cpp);
without it the bench prints why it skipped and ends with a JSON line saying so (exit 0).

Workload: the engine bench's (molora.bench.engine.workload): N random prompts of P token ids and G greedy new tokens
each, eos ignored, the same ids to both systems. molora: `Engine.generate` over all requests (continuous batching,
paged KV). llama.cpp: its low-level batched API as llama-server drives it: one context, one sequence id per request,
each `llama_decode` takes one token of every decoding sequence plus prompt chunks up to n_batch, greedy argmax over
the logits of the rows that asked for them. One LoRA (random, r=16, all seven projections, `make_adapters`) on both:
molora pins every request to it; llama.cpp sets it on the context (converted by molora.bench.peer_gguf).

Variants (`--variants`), each timed as four systems (molora, molora + LoRA, llama.cpp, llama.cpp + LoRA) with their
order rotated every repetition: molora's dtype/quantization against a GGUF type (VARIANTS). The F32/BF16 GGUFs hold
the very weights molora runs (peer_gguf.write_float_gguf); Q8_0/Q4_0/Q4_K_M are made from the F32 one by
llama.cpp's quantizer (`llama_model_quantize`). Files are cached under --cache (default $MOLORA_CACHE/peer).
Recorded: medians, paired ratios (llama.cpp time over molora time per repetition: > 1 means molora is faster), the LoRA
cost on each side, greedy agreement between the two, llama.cpp's version and system info, the GGUF's tensor types and
bytes beside molora's resident weight bytes (every copy, `quant_linear.weight_bytes`), threads, KV cache type, CPU
model/flags and load. Ends with one JSON line. Owns timing and reporting only.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from molora.bench.common import emit, machine_info, paired_ratio, rotated, rounded, stderr_log
from molora.bench.peer_gguf import head_counts, lora_to_gguf, tensor_types, write_float_gguf
from molora.errors import MoLoRAError

MISSING = (
    "llama.cpp peer skipped: llama-cpp-python is not installed (`pip install 'molora[peer]'` builds llama.cpp "
    "from source, 10-20 minutes on a small CPU)"
)
LLAMA_FTYPES = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama.h's llama_ftype
GGML_TYPES = {"F32": 0, "F16": 1, "BF16": 30}  # ggml.h's ggml_type, for the KV cache
# llama.cpp's extra buffer types (weights repacked for AMX or its CPU_REPACK kernels) are off by default here: with them
# on, llama_decode on a Q8_0 or Q4_0 model crashes (SIGSEGV) on this CPU (AMX_INT8) as soon as a batch holds more than a
# few tokens, in llama-cpp-python 0.3.36's own high-level `Llama` too, in a venv without torch: a llama.cpp issue of
# this build, not of this runner. Off, llama.cpp runs its plain CPU kernels on the same types.
EXTRA_BUFTS_NOTE = (
    "off: with them on, llama_decode crashed (SIGSEGV) on Q8_0/Q4_0 with multi-token batches, also in "
    "llama-cpp-python's own Llama without torch"
)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class Variant:
    """molora's base precision against the llama.cpp GGUF type that stores the same bits per weight."""

    dtype: torch.dtype  # molora's activations and float weights
    quantization: str | None  # molora's base linears: None, "int8" / "int4" (weight only), "w8a8"
    gguf_type: str  # the llama.cpp file
    kv_type: str  # llama.cpp's KV cache, matching molora's (its KV cache is in the activation dtype)
    quantize_lm_head: bool | None = None  # molora's LM head (and the tied embedding) quantized too (None: its default)


VARIANTS = {
    "fp32": Variant(torch.float32, None, "F32", "F32"),
    "bf16": Variant(torch.bfloat16, None, "BF16", "BF16"),
    "int8": Variant(torch.float32, "int8", "Q8_0", "F32"),
    # the LM head and the tied embedding in int8 too: molora's smallest int8 base (--quantize-lm-head)
    "int8-qhead": Variant(torch.float32, "int8", "Q8_0", "F32", quantize_lm_head=True),
    "int8-bf16": Variant(torch.bfloat16, "int8", "Q8_0", "BF16"),
    # int8 weights and activations, as llama.cpp's Q8_0 dot products (activations rounded to Q8 blocks)
    "w8a8": Variant(torch.float32, "w8a8", "Q8_0", "F32"),
    "int4": Variant(torch.bfloat16, "int4", "Q4_0", "BF16"),  # molora's int4 runs with bf16 activations
    "int4-k": Variant(torch.bfloat16, "int4", "Q4_K_M", "BF16"),
}
DEFAULT = ["fp32", "bf16", "int8", "int4"]
SYSTEMS = ("molora", "molora_lora", "llama.cpp", "llama.cpp_lora")


def load_llama_cpp() -> ModuleType | None:
    """The `llama_cpp` module, or None when llama-cpp-python is not installed (the bench then skips: MISSING)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def agreement(ref: list[list[int]], out: list[list[int]]) -> float:
    """Share of ref's tokens that out repeats before its first difference, over all requests."""
    same = 0
    for a, b in zip(ref, out):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(a) for a in ref))


# ------------------------------------------------------------------------------------------------ files


def gguf_file(llama: ModuleType, src: Path, gguf_type: str, cache: Path, threads: int) -> Path:
    """The default model as `gguf_type` under `cache`, made once: F32/BF16 by peer_gguf (molora's own floats),
    integer types by llama.cpp's quantizer from the F32 file."""
    dst = cache / f"{src.stem.split('.')[0]}-{gguf_type}.gguf"
    if dst.is_file():
        return dst
    if gguf_type in ("F32", "BF16"):
        return write_float_gguf(src, dst, gguf_type)
    f32 = gguf_file(llama, src, "F32", cache, threads)
    params = llama.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPES[gguf_type], threads
    tmp = dst.with_name(dst.name + ".part")
    if llama.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise MoLoRAError(f"llama_model_quantize failed making {gguf_type} from {f32} (llama.cpp's log above)")
    tmp.rename(dst)
    return dst


# ------------------------------------------------------------------------------------------------ llama.cpp


class LlamaCppPeer:
    """One llama.cpp model and context serving `n_seq` sequences at once (one sequence id each, llama-server's
    slots), greedy, through `llama_batch`/`llama_decode`; optionally one LoRA, switched on per run."""

    def __init__(
        self,
        llama: ModuleType,
        model_path: Path,
        *,
        n_seq: int,
        seq_len: int,
        n_batch: int,
        threads: int,
        kv_type: str,
        lora_path: Path | None = None,
        extra_bufts: bool = True,
    ) -> None:
        self.llama, self.n_batch = llama, n_batch
        llama.llama_backend_init()
        mp = llama.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = extra_bufts  # llama.cpp's repacked weight layouts (AMX, CPU_REPACK): see EXTRA_BUFTS_NOTE
        self.model = llama.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise MoLoRAError(f"llama.cpp cannot load {model_path} (its log above says why)")
        cp = llama.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = n_seq * seq_len, n_seq, True
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = GGML_TYPES[kv_type]
        cp.no_perf = True
        self.ctx = llama.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise MoLoRAError(f"llama.cpp cannot make a context for {model_path} (KV {kv_type}, {n_seq} sequences)")
        self.flash_attn_type = int(cp.flash_attn_type)
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.batch = llama.llama_batch_init(n_batch, 0, 1)
        self.lora = None
        if lora_path is not None:
            self.lora = llama.llama_adapter_lora_init(self.model, str(lora_path).encode())
            if not self.lora:
                raise MoLoRAError(f"llama.cpp refused the LoRA {lora_path} (its log above says why)")

    def use_lora(self, on: bool) -> None:
        """Apply the LoRA (scale 1: the file's alpha / r) to every sequence of the next runs, or none."""
        ll = self.llama
        if on:
            assert self.lora is not None
            arr = (ll.llama_adapter_lora_p_ctypes * 1)(self.lora)
            rc = ll.llama_set_adapters_lora(self.ctx, arr, 1, (ctypes.c_float * 1)(1.0))
        else:
            rc = ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        if rc != 0:
            raise MoLoRAError(f"llama_set_adapters_lora returned {rc}")

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b = self.batch
        i = b.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
        b.n_tokens = i + 1
        return i

    def generate(self, prompts: list[list[int]], news: list[int]) -> list[list[int]]:
        """Greedy new token ids per prompt (news[i] of them, eos ignored), all sequences batched together: each
        decode holds one token per decoding sequence first, then prompt chunks up to n_batch tokens."""
        ll = self.llama
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        fed = [0] * len(prompts)  # prompt tokens decoded so far, per sequence
        out: list[list[int]] = [[] for _ in prompts]
        while any(len(o) < n for o, n in zip(out, news)):
            self.batch.n_tokens = 0
            rows: list[tuple[int, int]] = []  # (sequence, batch row whose logits give its next token)
            for s, (p, o) in enumerate(zip(prompts, out)):
                if fed[s] == len(p) and 0 < len(o) < news[s]:
                    rows.append((s, self._add(o[-1], len(p) + len(o) - 1, s, True)))
            for s, p in enumerate(prompts):
                room = self.n_batch - self.batch.n_tokens
                if fed[s] < len(p) and room > 0:
                    for j in range(fed[s], min(len(p), fed[s] + room)):
                        last = j == len(p) - 1
                        row = self._add(p[j], j, s, last)
                        if last:
                            rows.append((s, row))
                    fed[s] = min(len(p), fed[s] + room)
            rc = ll.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise MoLoRAError(f"llama_decode returned {rc} (KV cache full? n_ctx too small for the workload)")
            for s, row in rows:
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
                out[s].append(int(logits.argmax()))
        return out

    def close(self) -> None:
        ll = self.llama
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        if self.lora is not None:
            ll.llama_adapter_lora_free(self.lora)
        ll.llama_model_free(self.model)


_LOG_CALLBACK: list[Any] = []  # the ctypes callback llama.cpp holds a pointer to: kept alive for the process


def ready_llama_cpp(bench: str) -> ModuleType | None:
    """`llama_cpp` with its log quiet, or None after saying why bench `bench` skips (stderr and its JSON line)."""
    llama = load_llama_cpp()
    if llama is None:
        print(MISSING, file=sys.stderr)
        emit({"bench": bench, "skipped": MISSING})
        return None
    quiet_llama_log(llama)
    return llama


def quiet_llama_log(llama: ModuleType) -> None:
    """llama.cpp's log (model loading: some hundred lines per model) to stderr from warnings up only. ggml.h's levels:
    DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line); the binding's own logger maps them
    one level off and prints INFO as a warning. Called by `main` only: importing this module changes nothing."""
    last = [0]

    def log(level: int, text: bytes, _user: Any) -> None:
        last[0] = last[0] if level == 5 else level
        if last[0] >= 3:
            print(text.decode(errors="replace"), end="", file=sys.stderr, flush=True)

    _LOG_CALLBACK[:] = [llama.llama_log_callback(log)]
    llama.llama_log_set(_LOG_CALLBACK[0], ctypes.c_void_p(0))


def llama_info(llama: ModuleType) -> dict[str, Any]:
    """What llama.cpp was: the binding's version (it pins one llama.cpp commit) and llama.cpp's system info."""
    return {
        "llama_cpp_python": getattr(llama, "__version__", None),
        "system_info": llama.llama_print_system_info().decode(errors="replace").strip(),
    }


# ------------------------------------------------------------------------------------------------ the bench


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_variant(
    name: str, llama: ModuleType, gguf: Path, lora_folder: Path, lora_gguf: Path, work: dict[str, Any]
) -> dict[str, Any]:
    """Build both systems at variant `name`, warm them, time the four systems interleaved (module docstring)."""
    from molora import attach
    from molora.config import SamplingParams
    from molora.engine import Engine
    from molora.model.base import load_base
    from molora.model.quant_linear import weight_bytes

    v = VARIANTS[name]
    prompts, news, threads = work["prompts"], work["news"], work["threads"]
    model, tok = load_base()
    calib = None  # w8a8: SmoothQuant's ranges from the rows molora.load reads (as experiments/bench_quant.py)
    if v.quantization == "w8a8":
        from molora.bundle import quant_calibration_rows

        calib = quant_calibration_rows(tok)
    mm = attach(
        model,
        {"skill0": lora_folder},
        quantization=v.quantization,
        calibration=calib,
        quantize_lm_head=v.quantize_lm_head,
    )
    if v.dtype != torch.float32:
        mm.to(v.dtype)
    engine = Engine(mm, work["engine_config"])
    seq_len = max(len(p) for p in prompts) + max(news) + 16
    peer = LlamaCppPeer(
        llama, gguf, n_seq=len(prompts), seq_len=seq_len, n_batch=512, threads=threads, kv_type=v.kv_type,
        lora_path=lora_gguf, extra_bufts=work["extra_bufts"],
    )  # fmt: skip
    params = [SamplingParams(max_new_tokens=n) for n in news]
    fns = {
        "molora": lambda: [r.new_token_ids for r in engine.generate(prompts, params, routing="none")],
        "molora_lora": lambda: [r.new_token_ids for r in engine.generate(prompts, params, adapter="skill0")],
        "llama.cpp": lambda: (peer.use_lora(False), peer.generate(prompts, news))[1],
        "llama.cpp_lora": lambda: (peer.use_lora(True), peer.generate(prompts, news))[1],
    }
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2), routing="none")  # warm-up (packing, prepack)
    peer.generate(prompts[:2], [2, 2])
    secs: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, list[list[int]]] = {}
    for i in range(work["repeats"]):
        for k in rotated(list(fns), i):
            t, outs[k] = _timed(fns[k])  # greedy: the same outputs every repetition
            secs[k].append(t)
            stderr_log(f"  {name} {k}: {t:.2f} s")
    peer.close()
    wb = weight_bytes(mm.model, engine.runner.packed_weights())  # every resident copy (the kernels' made by now)
    gen = sum(news)
    med = {k: statistics.median(s) for k, s in secs.items()}
    pair = lambda a, b: [round(x, 4) for x in paired_ratio(secs[a], secs[b])]  # noqa: E731 [median, q1, q3]
    return {
        "molora": {
            "dtype": str(v.dtype).removeprefix("torch."),
            "quantization": v.quantization,
            "weight_bytes": sum(wb.values()),
            "weight_bytes_by_kind": wb,
            "weights_over_gguf": round(sum(wb.values()) / gguf.stat().st_size, 4),
        },
        "llama.cpp": {
            "gguf_type": v.gguf_type,
            "tensor_types": tensor_types(gguf),
            "file_bytes": gguf.stat().st_size,
            "kv_type": v.kv_type,
            "flash_attn_type": peer.flash_attn_type,
        },
        "s": med,
        "tok_s": {k: gen / s for k, s in med.items()},
        "samples_s": {k: [round(x, 4) for x in s] for k, s in secs.items()},
        "llama_over_molora": pair("llama.cpp", "molora"),  # > 1: molora is faster
        "llama_over_molora_lora": pair("llama.cpp_lora", "molora_lora"),
        "lora_cost_molora": pair("molora_lora", "molora"),  # > 1: the LoRA slows it down
        "lora_cost_llama": pair("llama.cpp_lora", "llama.cpp"),
        "greedy_agreement": agreement(outs["molora"], outs["llama.cpp"]),
        "greedy_agreement_lora": agreement(outs["molora_lora"], outs["llama.cpp_lora"]),
        "lora_changed_molora_tokens": 1 - agreement(outs["molora"], outs["molora_lora"]),  # > 0: the LoRA is seen
        "identical_requests": sum(a == b for a, b in zip(outs["molora"], outs["llama.cpp"])),
        "identical_requests_lora": sum(a == b for a, b in zip(outs["molora_lora"], outs["llama.cpp_lora"])),
    }


def run(
    llama: ModuleType, variants: Sequence[str], requests: int, prompt_len: int, new_tokens: int, repeats: int,
    threads: int, cache: Path, extra_bufts: bool = False, on_variant: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    from molora.adapters.io import read_adapter
    from molora.bench.engine import bench_config, make_adapters, workload
    from molora.model.base import default_gguf_path, load_base
    from molora.model.lora_linear import linear_shapes

    torch.set_num_threads(threads)
    src = default_gguf_path()
    files = {name: gguf_file(llama, src, VARIANTS[name].gguf_type, cache, threads) for name in variants}
    n_head, n_kv, n_layers = head_counts(src)
    longest = prompt_len + new_tokens + 16
    record: dict[str, Any] = {
        "bench": "peer",
        "machine": {**machine_info(), "cpu_flags_all": _cpu_flags()},
        "llama_cpp": {
            **llama_info(llama),
            "n_threads": threads,
            "n_batch": 512,
            "api": "llama_batch/llama_decode",
            "extra_bufts": extra_bufts if extra_bufts else EXTRA_BUFTS_NOTE,
        },
        "source_gguf": {"file": src.name, "tensor_types": tensor_types(src)},
        "requests": requests,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "lora": "one random PEFT LoRA, r=16, alpha=32, all seven projections (molora.bench.engine.make_adapters)",
        "float_files": "molora.bench.peer_gguf.write_float_gguf (gguf-py dequantize: molora's own weights)",
        "quantized_files": "llama_model_quantize from the F32 file (llama.cpp's quantizer)",
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model, _tok = load_base()
        vocab = model.config.vocab_size
        lora_folder = make_adapters(model, Path(tmp), 1, 16)["skill0"]
        adapter = read_adapter(lora_folder, linear_shapes(model))
        lora_gguf = lora_to_gguf(adapter, Path(tmp) / "skill0.gguf", n_head, n_kv, n_layers)
        del model
        prompts, news = workload(requests, prompt_len, new_tokens, vocab, False)
        work = {
            "prompts": prompts,
            "news": news,
            "threads": threads,
            "repeats": repeats,
            "extra_bufts": extra_bufts,
            "engine_config": bench_config(requests, longest),
        }
        for name in variants:
            v = VARIANTS[name]
            stderr_log(f"# {name}: molora {v.dtype} {v.quantization or ''} vs {files[name].name}, KV {v.kv_type}")
            record["variants"][name] = measure_variant(name, llama, files[name], lora_folder, lora_gguf, work)
            gc.collect()  # the variant's model and engine go before the next one loads
            record["machine"]["loadavg_after"] = machine_info()["loadavg_1_5_15"]
            if on_variant is not None:  # e.g. write the record so far: a long run stopped early keeps its variants
                on_variant(record)
    return record


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return [f for f in CPU_FLAGS if f in line.split(":", 1)[1].split()]
    except OSError:
        pass
    return []


def summary_lines(record: dict[str, Any]) -> list[str]:
    """One line per variant: tok/s of the four systems, llama.cpp/molora paired, LoRA costs, greedy agreement."""
    out = []
    for name, v in record["variants"].items():
        t = v["tok_s"]
        out.append(
            f"{name:>9} vs {v['llama.cpp']['gguf_type']:<6}: molora {t['molora']:6.1f} tok/s (+LoRA "
            f"{t['molora_lora']:6.1f}) | llama.cpp {t['llama.cpp']:6.1f} (+LoRA {t['llama.cpp_lora']:6.1f}) | "
            f"llama.cpp/molora time x{v['llama_over_molora'][0]:.2f}, with LoRA x{v['llama_over_molora_lora'][0]:.2f}"
            f" | greedy agree {v['greedy_agreement']:.2f} (LoRA {v['greedy_agreement_lora']:.2f})"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molora bench peer", description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS), help="precisions to compare")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests (default 16)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and llama.cpp threads (default 1: at 2 on a loaded 2-core machine both stall in OpenMP barriers)",
    )
    ap.add_argument("--cache", type=Path, help="where the GGUF files are made (default $MOLORA_CACHE/peer)")
    ap.add_argument(
        "--llama-extra-bufts",
        action="store_true",
        help="let llama.cpp repack weights (AMX, CPU_REPACK); off by default: it crashed on Q8_0/Q4_0 here",
    )
    ap.add_argument("--json", metavar="OUT", help="also write the record to this file")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--speculative" in argv:  # batch 1 with prompt lookup on both sides (molora.bench.peer_speculative)
        from molora.bench import peer_speculative

        i = argv.index("--speculative")
        if i + 1 >= len(argv):
            print("molora bench peer: --speculative takes vLLM's speculative config JSON", file=sys.stderr)
            return 2
        return peer_speculative.main(argv[:i] + argv[i + 2 :], argv[i + 1])
    args = ap.parse_args(argv)
    llama = ready_llama_cpp("peer")
    if llama is None:
        return 0
    from molora.model.base import cache_root

    cache = args.cache or cache_root() / "peer"
    save = (lambda r: Path(args.json).write_text(json.dumps(rounded(r), indent=1) + "\n")) if args.json else None
    a = args
    rec = run(
        llama,
        a.variants,
        a.requests,
        a.prompt_len,
        a.new_tokens,
        a.repeats,
        a.threads,
        cache,
        a.llama_extra_bufts,
        save,
    )
    rec = {"command": "molora bench peer " + " ".join(argv), **rec}
    print("\n".join(summary_lines(rec)), flush=True)
    emit(rec, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
