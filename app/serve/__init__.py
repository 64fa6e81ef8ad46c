"""`npuchat serve`: an OpenAI- and Anthropic-compatible HTTP service over the `ChatEngine` port.

A thin ASGI layer (Starlette + uvicorn): the OpenAI schema in (`schema`), engine events out as
JSON or server-sent events (`routes`, `responses`); OpenAI's Responses and Anthropic's Messages
APIs read as the chat completions they mean (`responses_in`, `messages_in`); a bounded
admission queue in front of the engine (`runner`), API keys (`auth`), web pages kept out
(`browsers`) and Prometheus figures (`metrics`). It knows nothing of how the engine is built:
`server.create_app` takes any `ChatEngine`.
"""
