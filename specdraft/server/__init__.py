"""``specdraft serve``: the OpenAI-compatible server (``app``) and its engine (``engine``).

``specdraft.server.engine`` has no web dependencies; ``specdraft.server.app`` needs FastAPI and uvicorn.
"""
