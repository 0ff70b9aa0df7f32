"""The HTTP translation server: the app (`app`: Starlette routes, bounds, the page), the
request batcher (`batcher`), and its engines (`jax_engine`, `ctranslate2_engine`)."""
