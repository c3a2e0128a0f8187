"""prefix-router: an OpenAI-compatible gateway that routes each request to the vLLM replica
most likely to hold its prompt's prefix in its KV cache."""

__version__ = "0.1.0"
