"""Starlette app: OpenAI-compatible HTTP API, SSE streaming, health."""
