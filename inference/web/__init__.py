"""The web process: the HTTP and WebSocket surfaces Hypnos serves, one package each.

`openai` (`/v1`, the wire contract, Hypnos's own routes included), `ollama` (`/api/*`),
`anthropic` (`/v1/messages`) and `lemonade` (`/api/v1/*`) hold the same files: `urls.py` (the
route table), `views.py`, `protocol.py` (the wire models) and `serving*.py` (what a request
does). `common` holds what every surface shares: the request context, the one place errors are
rendered, the body parsers, the middleware, the pool overlay and the registry pulls. A surface
imports `common` and `inference.transport`, never another surface, and nothing here imports an
engine or the worker (tests/unit/test_dependencies.py).
"""
