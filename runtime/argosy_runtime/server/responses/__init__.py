"""OpenAI's Responses API (`/v1/responses`) on top of chat completions; see docs/server.md."""

from argosy_runtime.server.responses.background import BackgroundRuns
from argosy_runtime.server.responses.routes import add_responses_routes
from argosy_runtime.server.responses.store import ResponseStore

__all__ = ["BackgroundRuns", "ResponseStore", "add_responses_routes"]
