"""Prompt -> token ids, exactly as vLLM 0.34.0 renders and tokenizes them.

The router must hash the same token ids the replica will see, or its prefix index is keyed on
the wrong blocks. So this package re-implements, step by step, what vLLM's OpenAI server does
to a request body before the engine gets it (``vllm/entrypoints/openai/*/protocol.py``,
``vllm/renderers/{online_renderer,hf,base,params}.py``, ``vllm/renderers/chat_utils/``), and
renders the chat template in a Jinja environment built the way ``transformers`` builds it
(5.22, the version the vLLM 0.34.0 oracle runs). ``tests/prompt/`` pins the behaviour against
fixtures produced by vLLM itself (``tools/make_oracle_fixtures.py``); docs/prompt-rendering.md
lists the normalisations.

One job per module:
  renderer     ``Renderer``, the facade the gateway and the simulator use
  normalize    the chat body -> the template's inputs (messages, developer -> system)
  chat_params  tools, tool_choice, chat_template_kwargs
  template     the chat template: chosen, compiled once, rendered
  jinja        the sandboxed Jinja environment and content-format detection
  limits       vLLM's TokenizeParams: truncation, context length, the character budget
  completion   completions prompts and client-sent token ids
  segments     the segment-cache tokenizer (``cache_scope``, ``inline`` / ``NeedsThread``)
  fields       lax request values, plain-JSON copies, errors
"""

from router.core.salt import validate_cache_salt
from router.prompt.completion import MAX_COMPLETION_PROMPTS
from router.prompt.fields import TokenIds
from router.prompt.jinja import ContentFormat, detect_content_format
from router.prompt.limits import DEFAULT_MAX_PROMPT_CHARS
from router.prompt.renderer import Renderer
from router.prompt.scope import NeedsThread, cache_scope_seed
from router.prompt.segments import DEFAULT_SEGMENT_CACHE_TOKENS

__all__ = [
    "DEFAULT_MAX_PROMPT_CHARS",
    "DEFAULT_SEGMENT_CACHE_TOKENS",
    "MAX_COMPLETION_PROMPTS",
    "ContentFormat",
    "NeedsThread",
    "Renderer",
    "TokenIds",
    "cache_scope_seed",
    "detect_content_format",
    "validate_cache_salt",
]
