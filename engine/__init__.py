"""npuchat engine: GGUF -> static-shape ONNX graphs over a preallocated KV cache.

The engine never imports Textual: the app talks to it through `npuchat.engine.session`.
"""
