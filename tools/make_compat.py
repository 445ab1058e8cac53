"""The compatibility table of docs/serving.md: every OpenAI and vLLM request field and endpoint, and what molora does
with it (supported, partly, ignored, or refused with a 400), read from the server's own request models and routes so
that it cannot drift from them.

    python -m tools.make_compat            # rewrite the block in docs/serving.md
    python -m tools.make_compat --check    # exit 1 when the block is stale

A field is "refused" exactly when the request model does not declare it (the models refuse unknown fields with a 400
naming them: tests/test_compat.py sends each one); a declared field is "supported" unless NOTES says how far. The
lists of what OpenAI and vLLM send are this file's (their APIs, as of their current documentation).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from molora.docblock import replace_block
from molora.server.protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = "<!-- compat:begin (tools/make_compat.py) -->", "<!-- compat:end -->"

# what clients send: OpenAI's request fields, then vLLM's extensions (its SamplingParams and request extras)
OPENAI_CHAT = (
    "messages model audio frequency_penalty function_call functions logit_bias logprobs max_completion_tokens "
    "max_tokens metadata modalities n parallel_tool_calls prediction presence_penalty prompt_cache_key "
    "reasoning_effort response_format safety_identifier seed service_tier stop store stream stream_options "
    "temperature tool_choice tools top_logprobs top_p user verbosity web_search_options"
).split()
OPENAI_COMPLETIONS = (
    "model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    "stream_options suffix temperature top_p user"
).split()
VLLM = (
    "top_k min_p repetition_penalty length_penalty use_beam_search stop_token_ids include_stop_str_in_output "
    "ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs "
    "allowed_token_ids bad_words structured_outputs guided_json guided_regex guided_choice guided_grammar "
    "guided_decoding_backend guided_whitespace_pattern add_generation_prompt continue_final_message "
    "add_special_tokens chat_template chat_template_kwargs documents priority request_id logits_processors "
    "return_tokens_as_token_ids cache_salt"
).split()
ENDPOINTS = {  # what OpenAI clients and vLLM's tools call
    ("POST", "/v1/chat/completions"): "OpenAI",
    ("POST", "/v1/completions"): "OpenAI",
    ("GET", "/v1/models"): "OpenAI",
    ("POST", "/v1/embeddings"): "OpenAI",
    ("POST", "/v1/responses"): "OpenAI",
    ("POST", "/v1/audio/transcriptions"): "OpenAI",
    ("POST", "/v1/load_lora_adapter"): "vLLM",
    ("POST", "/v1/unload_lora_adapter"): "vLLM",
    ("POST", "/tokenize"): "vLLM",
    ("POST", "/detokenize"): "vLLM",
    ("GET", "/health"): "vLLM",
    ("GET", "/metrics"): "vLLM",
    ("GET", "/version"): "vLLM",
    ("POST", "/score"): "vLLM",
    ("POST", "/rerank"): "vLLM",
}
# how far a declared field goes, where not all the way (tests/test_compat.py: every key is a declared field)
NOTES = {
    "suffix": "accepted empty only; insertion is refused (400)",
    "best_of": "only best_of == n (400 otherwise)",
    "user": "the request's tenant when its API key has no name (fair share, per-tenant limits and metrics)",
    "priority": "lower first with --scheduling-policy priority; non-zero under another policy is a 400",
    "store": "accepted, not used (nothing is stored)",
    "metadata": "accepted, not used (nothing is stored)",
    "chat_template_kwargs": "variables for the tokenizer's own chat template (e.g. enable_thinking); the ones the "
    "server renders itself are refused",
    "stream_options": "include_usage",
    "n": "up to 16",
    "logprobs": "completions: top 0-20, with echo the prompt's too; chat: true/false with top_logprobs 0-20",
    "top_logprobs": "0-20",
    "prompt_logprobs": "0-20 (not -1), not with stream",
    "stop": "up to 4 strings",
    "tool_choice": "none, auto (with --enable-auto-tool-choice), required, a named function: the last two "
    "enforced by the grammar engine",
    "response_format": "text, json_object, json_schema (grammar-enforced; strict refuses what it cannot enforce)",
    "structured_outputs": "json, regex, choice, grammar, json_object (disable_any_whitespace accepted: output is "
    "compact anyway)",
    "max_tokens": "0 only with echo",
    "molora": "molora's own options: routing, adapters, return_routing, timeout",
}


def fields(model: type) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def field_rows() -> list[str]:
    chat, comp = fields(ChatCompletionRequest), fields(CompletionRequest)
    rows = ["| field | from | chat | completions | notes |", "|---|---|---|---|---|"]
    seen: set[str] = set()
    for origin, names in (("OpenAI", OPENAI_CHAT + OPENAI_COMPLETIONS), ("vLLM", VLLM), ("molora", ["molora"])):
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            in_chat = name in OPENAI_CHAT or origin != "OpenAI"
            in_comp = name in OPENAI_COMPLETIONS or origin != "OpenAI"
            cells = [_cell(name, chat) if in_chat else "n/a", _cell(name, comp) if in_comp else "n/a"]
            rows.append(f"| `{name}` | {origin} | {cells[0]} | {cells[1]} | {NOTES.get(name, '')} |")
    return rows


def _cell(name: str, declared: set[str]) -> str:
    if name not in declared:
        return "refused (400)"
    return "partly" if name in NOTES and name != "molora" else "supported"


def endpoint_rows(routes: set[tuple[str, str]]) -> list[str]:
    rows = ["| endpoint | from | molora |", "|---|---|---|"]
    for (method, path), origin in ENDPOINTS.items():
        rows.append(
            f"| `{method} {path}` | {origin} | {'served' if (method, path) in routes else 'not served (404)'} |"
        )
    return rows


def served_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, read from a built app (over a stub engine: no model loaded)."""
    from molora.server.app import build_app
    from molora.server.catalog import Catalog, ModelInfo

    app = build_app(_StubClient(), Catalog([ModelInfo(name="m", tokenizer=None, stop_token_ids=(), vocab_size=1)]))
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or () if m != "HEAD"}


class _StubClient:
    """Enough of an EngineClient to build the app and list its routes (nothing is served)."""

    max_in_flight = 1

    def attach(self, **_: object) -> None:
        pass


def render() -> str:
    lines = [
        BEGIN,
        "Rendered by `python -m tools.make_compat` from the request models (molora/server/protocol.py) and the app's "
        "routes: a field the models do not declare is refused with a 400 naming it (tests/test_compat.py sends each).",
        "",
        *field_rows(),
        "",
        *endpoint_rows(served_routes()),
        END,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/serving.md's block is stale")
    args = p.parse_args(argv)
    text = PAGE.read_text()
    new = replace_block(text, BEGIN, END, render(), PAGE)
    if args.check:
        return 0 if new == text else 1
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
