"""The other APIs vLLM serves beside chat/completions: Anthropic Messages, OpenAI Responses,
and the endpoints the gateway only forwards. Each converter turns its API's body into the
chat-completions body vLLM builds from it internally, so the gateway predicts the same ids."""
