"""`npuchat serve`: an OpenAI-compatible HTTP service over the `ChatEngine` port.

A thin ASGI layer (Starlette + uvicorn): the OpenAI schema in (`schema`), engine events out as
JSON or server-sent events (`routes`, `responses`), a bounded admission queue in front of the
engine (`runner`), bearer auth (`auth`) and Prometheus figures (`metrics`). It knows nothing of
how the engine is built: `server.create_app` takes any `ChatEngine`.
"""
