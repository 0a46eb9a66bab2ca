"""`python -m colibri serve`: an OpenAI-compatible HTTP server over one Model.

The package, split by job (as vLLM's entrypoints/openai):
    protocol.py   the request bodies (pydantic): every field's type, range and meaning; /openapi.json
    openai.py     a validated request -> the engine's work (a Job): prompt, sampling, constraint, reply parsing
    engine.py     the served model: the FIFO of places, the engine thread, generations alone or batched
    app.py        the HTTP app (FastAPI): routes, auth, bodies, whole and streamed answers; serve()
    connection.py the connections under it (uvicorn's h11 protocol): malformed HTTP in the API's shape
    limits.py     sizes and timings; errors.py: OpenAI-shaped errors
The reply parsers live with the chat templates (colibri/chat.py, colibri/replies.py) and the
constraints with the engine (colibri/constraint.py): the Python API uses them too.
"""

from .app import create_app, serve
from .engine import Served
from .errors import APIError

__all__ = ["APIError", "Served", "create_app", "serve"]
