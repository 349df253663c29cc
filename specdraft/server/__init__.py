"""``specdraft serve``: the OpenAI-compatible server (``app``) over the request queue (``queue``).

``specdraft.server.queue`` has no web dependencies; ``specdraft.server.app`` needs FastAPI and uvicorn.
"""
