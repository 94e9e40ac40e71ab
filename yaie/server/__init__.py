"""An OpenAI-compatible HTTP server on the engine: ``yaie serve`` (see ``docs/server.md``).

``create_app(LLM(...))`` is the FastAPI app (:mod:`yaie.server.app`; ``api_key=``, ``limits=`` and
``shutdown_grace_s=`` for serving a class); :mod:`yaie.server.protocol` checks OpenAI request bodies and shapes
the errors; :mod:`yaie.engine.async_engine` is the engine loop behind it.
"""

from yaie.server.app import create_app

__all__ = ["create_app"]
