"""molora's OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn).

    from molora.server import serve
    serve("path/to/bundle", port=8000, api_keys=["sk-local"])

Files: protocol (wire format and errors), runner (the engine thread), client (the engine client the app talks
to: in process), generation (completions and chat), metrics (Prometheus text), app (routes, auth, adapters,
draining), launch (uvicorn, SIGTERM drain), ray_serve (`molora serve --ray`: the same app over Ray Serve
engine replicas; the only module that imports ray, and nothing here imports it).
"""

from molora.server.app import create_app, resolve_adapter_path
from molora.server.launch import ServerThread, build_engine, serve

__all__ = ["ServerThread", "build_engine", "create_app", "resolve_adapter_path", "serve"]
