"""Serving with your adapters, used by a client nobody here wrote (the openai SDK).

    .venv/bin/python examples/serve_openai.py

Starts the OpenAI-compatible server in this process on the embedded default bundle (the same app `molora serve`
runs), with an API key, an admin key and an adapter root, then talks to it the way any OpenAI client does. Each step
names the module that answers it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import httpx
import openai

import molora
from molora.engine import Engine, EngineConfig
from molora.server import ServerThread, create_app


def main() -> None:
    # 1. An adapter root: the only folder adapters may be loaded from at run time (molora.server.state). Here a copy of
    #    one of the bundle's own adapters, to load under a new name in step 7.
    mm = molora.load()
    root = Path(tempfile.mkdtemp(prefix="molora-adapters-"))
    shutil.copytree(mm.bundle.adapters[0].path, root / "my-counting")  # paths in a parsed bundle are resolved

    # 2. The engine and the app: vLLM's flags have the same names on `molora serve` (docs/serving.md).
    engine = Engine(mm, EngineConfig(max_num_seqs=8, max_model_len=2048))
    app = create_app(engine, api_keys=["user-key", "admin-key"], admin_keys=["admin-key"], adapter_roots=[root])
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="user-key")

        # 3. The models: the bundle (per-token routing) and each adapter (pinned), as vLLM lists LoRAs.
        print("models:", [m.id for m in client.models.list()])

        # 4. Chat on the bundle: each token goes to the adapter the learned router picks; molora's extension asks
        #    for the routing back (molora.server.generation).
        r = client.chat.completions.create(
            model="molora-default",
            messages=[{"role": "user", "content": "Is 3 + 4 * 2 equal to 11?"}],
            max_tokens=40,
            temperature=0,
            extra_body={"molora": {"return_routing": True}},
        )
        routed = r.choices[0].model_extra["molora"]["adapters"]
        print("routed:", r.choices[0].message.content, "| adapters:", sorted({a or "base" for a in routed}))

        # 5. Structured output: a JSON schema, enforced by the grammar engine (molora.structured).
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        }
        r = client.chat.completions.create(
            model="molora-default",
            messages=[{"role": "user", "content": "Plan a trip to Paris for three days as JSON."}],
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}},
        )
        print("json:", json.loads(r.choices[0].message.content))

        # 6. A tool call: a named tool_choice is enforced by the same grammar engine (molora.server.tools).
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        r = client.chat.completions.create(
            model="molora-default",
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40,
        )
        call = r.choices[0].message.tool_calls[0]
        print("tool call:", call.function.name, call.function.arguments, "| finish:", r.choices[0].finish_reason)

        # 7. Load an adapter while serving (vLLM's endpoint; admin key; the path must lie under the root), then pin it.
        admin = httpx.post(
            url + "/load_lora_adapter",
            json={"lora_name": "mine", "lora_path": "my-counting"},
            headers={"Authorization": "Bearer admin-key"},
        )
        print("load:", admin.status_code, admin.text)
        r = client.completions.create(model="mine", prompt="Count: a cat, two dogs.", max_tokens=20, temperature=0)
        print("pinned to mine:", r.choices[0].text.strip())

        # 8. Prompt log-probabilities (what lm-eval's multiple-choice tasks ask): echo the prompt with its scores.
        r = client.completions.create(
            model="molora-default", prompt="The sky is blue", max_tokens=0, echo=True, logprobs=1
        )
        lp = r.choices[0].logprobs
        print(
            "prompt logprobs:", [(t, None if p is None else round(p, 2)) for t, p in zip(lp.tokens, lp.token_logprobs)]
        )
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
