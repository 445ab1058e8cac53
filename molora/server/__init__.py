"""molora's OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn).

    from molora.server import serve
    serve("path/to/bundle", port=8000, api_keys=["sk-local"])

Files: protocol (wire format and errors), runner (the engine thread), client (the engine client the app talks
to: in process), catalog (the bundles served and the model ids they answer to), generation (completions and
chat), openai_format (their JSON responses, stream chunks and usage), metrics (Prometheus text), state (what the
routes share; adapter loads and unloads), app (routes, auth, errors, draining), launch (uvicorn, SIGTERM drain),
ray_serve (`molora serve --ray`: the same app over Ray Serve engine replicas; the only module that imports ray,
and nothing here imports it).
"""

from molora.server.app import create_app
from molora.server.launch import ServerThread, build_engine, serve
from molora.server.state import resolve_adapter_path

__all__ = ["ServerThread", "build_engine", "create_app", "resolve_adapter_path", "serve"]
