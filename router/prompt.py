"""Prompt -> token ids, exactly as vLLM 0.34.0 renders and tokenizes them.

The router must hash the same token ids the replica will see, or its prefix index is keyed on
the wrong blocks. So this module re-implements, step by step, what vLLM's OpenAI server does
to a request body before the engine gets it (``vllm/entrypoints/openai/*/protocol.py``,
``vllm/renderers/{online_renderer,hf,base,params}.py``, ``vllm/renderers/chat_utils/``), and
renders the chat template in a Jinja environment built the way ``transformers`` builds it
(5.22, the version the vLLM 0.34.0 oracle runs). It does not call
``tokenizer.apply_chat_template``: later ``transformers`` releases changed what that does to
messages (5.24 drops ``None``-valued keys), and rendering the compiled template directly is also
cheaper. ``tests/test_prompt.py`` pins the behaviour against fixtures produced by vLLM itself
(``tools/make_oracle_fixtures.py``); the README section "Prompt rendering" lists the normalisations.

Fast path: Hugging Face tokenizers cut the text at added tokens (``<|im_start|>``, ...) before
normalising and running BPE, so a rendered prompt's ids are the concatenation of each
segment's ids. With ``segment_cache=True`` the ids of each segment are kept in an LRU keyed by
the XXH3-128 of its UTF-8 bytes, seeded by the request's cache-salt scope (``cache_scope``), and
bounded by the number of cached tokens, so a repeated 3,000-token system prompt costs a hash
and a dict lookup. The split is only used when it is provably equivalent for the tokenizer (see
``_segment_split_safe``); otherwise the whole prompt is encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import xxhash

from router.errors import APIError, bad_request

# Prompt token ids: an ``array('I')`` from the segment cache, a list elsewhere.
TokenIds = Sequence[int]

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_CHARS = 4_000_000
"""Largest rendered prompt (characters) accepted; longer ones are a 400, not minutes of CPU."""

DEFAULT_SEGMENT_CACHE_TOKENS = 2_000_000
"""Token budget of the segment cache (ids are stored as 4-byte ints: ~8 MB plus per-entry
overhead)."""

MAX_COMPLETION_PROMPTS = 1024
"""vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default."""

ContentFormat = Literal["string", "openai"]

# --------------------------------------------------------------------------------------------
# Request-level constants, from vLLM 0.34.0
# --------------------------------------------------------------------------------------------

_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_UNSET = (None, "auto")  # vllm.renderers.params.merge_kwargs: override values that are ignored

# Content part type -> the key holding its text (chat_message.MM_PARSER_MAP / TEXT_PART_TYPES).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)
_MEDIA_KEYS = _MEDIA_PARTS  # a part carrying one of these keys is media, whatever its type
_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})  # may send "content": null

_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Parameters of transformers' ``apply_chat_template`` (5.22): vLLM lets request
# chat_template_kwargs through when they are one of these or a variable of the template
# (vllm.renderers.hf.resolve_chat_template_kwargs).
_HF_CHAT_PARAMS = frozenset(
    {
        "self",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# Passing one of these as a chat_template_kwarg makes a Python call in vLLM fail with
# "got multiple values for argument ..." (a rejected request): safe_apply_chat_template's own
# parameters (checked before the kwargs are filtered), and apply_chat_template's / the
# template's (checked after).
_COLLIDING_KWARGS_ANY = frozenset({"model_config", "tokenizer", "conversation"})
_COLLIDING_KWARGS = frozenset({"self", "messages"})


def _error(message: str, param: str | None = None) -> APIError:
    return bad_request(message, param)


# --------------------------------------------------------------------------------------------
# Jinja environment, as transformers 5.22 ``_cached_compile_jinja_template`` builds it
# --------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (assistant-mask tracking is
    not needed here)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _template_error_reason(exc: BaseException) -> str:
    """The most specific reason in a template error chain (vllm.renderers.hf)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    # Anything else is Python's own text (a TypeError naming internals): logged, not echoed.
    log.debug("chat template failed: %s: %.300s", type(exc).__name__, exc)
    return "a value in the request has a type or shape the template cannot render"


# --------------------------------------------------------------------------------------------
# Content-format detection (vllm.renderers.hf._detect_content_format, ported): does the
# template loop over ``message.content``? Then content is handed over as a list of parts
# ("openai"), else as one string ("string"; Qwen3 is "string").
# --------------------------------------------------------------------------------------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _attr_dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _iter_assign_var_or_elems(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    yield varname
    seen = {varname}
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, name):
                yield lhs.name
                if lhs.name != name and lhs.name not in seen:
                    seen.add(lhs.name)
                    related.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems_access(kw.value, name)
                ]
            elif isinstance(
                lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)
            ) and _is_var_or_elems_access(rhs, name):
                dotted = _attr_dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != name and alias not in seen:
                    seen.add(alias)
                    related.append(alias)


def _message_loop_vars(root: jinja2.nodes.Node) -> list[str]:
    names = list(_iter_assign_var_or_elems(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        for name in names:
            if _is_var_or_elems_access(loop.iter, name) and isinstance(
                loop.target, jinja2.nodes.Name
            ):
                out.append(loop.target.name)
                break
    return out


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    message_vars = _message_loop_vars(root)
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                        _is_var_or_elems_access(arg, v, "content") for v in message_vars
                    ):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in param_names and any(
                        _is_var_or_elems_access(kw.value, v, "content") for v in message_vars
                    ):
                        content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_vars):
            return True
        params = params_by_loop.get(id(loop))
        if (
            isinstance(loop.iter, jinja2.nodes.Name)
            and params is not None
            and loop.iter.name in params
        ):
            return True
        if (
            id(loop) not in loops_in_macros
            and isinstance(loop.iter, jinja2.nodes.Name)
            and loop.iter.name == "content"
        ):
            return True
    return False


def detect_content_format(env: jinja2.Environment, template: str) -> ContentFormat:
    try:
        return "openai" if _loops_over_content(env.parse(template)) else "string"
    except Exception:  # vLLM falls back to "string" when the AST cannot be analysed
        return "string"


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A deep copy made of plain JSON types (what transformers' ``_plain_template_data`` hands
    the template), so rendering never touches the caller's body."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _as_token_id(value: Any) -> int | None:
    """An int as pydantic's lax mode accepts it for ``list[int]`` (bool, integral float)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def validate_cache_salt(salt: Any) -> None:
    """vLLM's cache_salt rule: a non-empty string, <= 128 chars, none of ``@ / \\`` or NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise _error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise _error(
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\', or NUL.",
            "cache_salt",
        )


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_bool(value: Any) -> bool | None:
    """A bool as pydantic's lax mode reads one (vLLM's request models): True/False, 0/1,
    "true"/"yes"/"on"/"1"/... (case-insensitive); None when it is not a valid boolean."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE_STRINGS:
            return True
        if lowered in _FALSE_STRINGS:
            return False
    return None


def _bool_field(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A required-bool request field (absent -> default; null or not a boolean -> 400)."""
    if key not in body:
        return default
    value = _lax_bool(body[key])
    if value is None:
        raise _error(f"'{key}' must be a boolean", key)
    return value


class _Truncation:
    """vLLM's TokenizeParams, restricted to what changes or rejects prompt ids."""

    __slots__ = ("max_output_tokens", "side", "tokens")

    def __init__(self, body: Mapping[str, Any], *, chat: bool) -> None:
        tokens = body.get("truncate_prompt_tokens")
        if tokens is not None and (_as_token_id(tokens) is None or tokens < -1):
            raise _error(
                "'truncate_prompt_tokens' must be an integer >= -1", "truncate_prompt_tokens"
            )
        side = body.get("truncation_side")
        if side not in (None, "left", "right"):
            raise _error("`truncation_side` must be either 'left' or 'right'.", "truncation_side")
        self.tokens: int | None = None if tokens is None else int(tokens)
        self.side: str | None = side
        if chat:
            mct = body.get("max_completion_tokens")
            self.max_output_tokens: int | None = mct if mct is not None else body.get("max_tokens")
        else:
            self.max_output_tokens = body.get("max_tokens", 16) or 0


# --------------------------------------------------------------------------------------------
# The renderer
# --------------------------------------------------------------------------------------------


class NeedsThread(Exception):
    """Raised inside ``Renderer.inline(...)`` when the prompt has more uncached text than the
    inline budget: the caller should tokenize it in a worker thread instead."""


# Per-thread (per-context) budget of uncached characters to BPE-encode inline; None = any.
_INLINE_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "prefix_router_inline_budget", default=None
)
# Seed of the segment-cache keys in this context: the request's cache-salt scope (0 = the
# unsalted scope). A hit is fast and a miss is slow, so a cache shared across scopes would
# let one tenant time whether another recently sent a text; keys seeded by the scope keep
# the scopes as far apart as the replicas' salted prefix caches are.
_CACHE_SCOPE: contextvars.ContextVar[int] = contextvars.ContextVar(
    "prefix_router_cache_scope", default=0
)


def cache_scope_seed(cache_salt: str | None) -> int:
    """The segment-cache seed of requests sent with ``cache_salt`` (0 when unsalted)."""
    if not cache_salt:
        return 0
    return xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass")) or 1


class Renderer:
    """Renders and tokenizes requests for one model's tokenizer, as vLLM 0.34.0 does.

    ``tokenize_chat(body)`` and ``tokenize_completion_request(body)`` are the live path;
    ``segment_cache=False`` gives the plain whole-prompt path (what the simulated replica uses).

    Options:
      segment_cache_tokens: token budget of the segment LRU.
      max_prompt_chars: the ``token_budget`` guard; a rendered prompt (or completions string)
        longer than this is a 400.
      max_model_len: when set, enforce vLLM's context-length checks and resolve
        ``truncate_prompt_tokens=-1`` (vLLM: the replica's ``--max-model-len``). None: do not
        enforce (the replica will) and treat -1 as no truncation.
      vocab_size: token ids given in a completions prompt must be < this (default: the
        tokenizer's length; vLLM accepts up to the model's vocab size, 151936 for Qwen3).
      chat_template: a server-side ``--chat-template`` override (template text).
      content_format: "string" / "openai" / None (detect from the template, as vLLM does;
        Qwen3 is "string", the only format checked against the oracle).
      truncation_side: default side of ``truncate_prompt_tokens`` (vLLM: "left").
      default_chat_template_kwargs: the replicas' ``--default-chat-template-kwargs``.
      trust_request_mm_kwargs: the replicas' ``--trust-request-mm-kwargs``.

    ``self.segment_cache`` is True when the fast path is in use (requested and safe for this
    tokenizer); ``cache_info()`` has its counters.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        segment_cache: bool = True,
        segment_cache_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        chat_template: str | None = None,
        content_format: ContentFormat | None = None,
        truncation_side: str = "left",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        trust_request_mm_kwargs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.default_chat_template_kwargs: dict[str, Any] = _plain(
            dict(default_chat_template_kwargs or {})
        )
        self.trust_request_mm_kwargs = trust_request_mm_kwargs
        self.max_prompt_chars = int(max_prompt_chars)
        self.max_model_len = max_model_len
        self.vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        # vLLM loads generation tokenizers with truncation_side="left"
        # (vllm/tokenizers/registry.py); it is the default side for truncate_prompt_tokens.
        self.truncation_side = truncation_side
        self._env = _jinja_env()
        self._template_source = (
            chat_template
            if chat_template is not None
            else getattr(tokenizer, "chat_template", None)
        )
        self._templates: dict[str, tuple[jinja2.Template, frozenset[str], bool, ContentFormat]] = {}
        self._forced_format = content_format
        special_map = getattr(tokenizer, "special_tokens_map", None) or {}
        self._special_tokens_map: dict[str, Any] = {
            k: _plain(v) for k, v in dict(special_map).items() if v is not None
        }
        self._max_chars: int | None = None  # longest token string, computed on first use

        # tokenization backend + segment cache
        self._backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None
        )
        self._cache: OrderedDict[int, array[int]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._cache_tokens = 0
        self.segment_cache_tokens = int(segment_cache_tokens)
        self.cache_hits = 0
        self.cache_misses = 0
        self._added: dict[str, int] = {}
        self._split_re: re.Pattern[str] | None = None
        self._special_adds_nothing = False
        self.segment_cache_requested = segment_cache
        reason = self._segment_split_safe() if segment_cache else "disabled"
        self.segment_cache = reason is None
        if segment_cache and reason is not None:
            log.warning("segment cache disabled for this tokenizer: %s", reason)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> Renderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), **kwargs)

    # ---------------------------------------------------------------------------- templates
    def _template(self, tools: Any) -> tuple[jinja2.Template, frozenset[str], bool, ContentFormat]:
        """The compiled template for this request (transformers' ``get_chat_template``), its
        undeclared variables, whether it knows the developer role, and its content format."""
        source = self._template_source
        if isinstance(source, dict):
            if tools is not None and "tool_use" in source:
                source = source["tool_use"]
            elif "default" in source:
                source = source["default"]
            else:
                raise _error("the model has several chat templates and none is the default")
        if not isinstance(source, str):
            raise _error(
                "As of transformers v4.44, default chat template is no longer "
                "allowed, so you must provide a chat template if the tokenizer does "
                "not define one."
            )
        hit = self._templates.get(source)
        if hit is None:
            try:
                compiled = self._env.from_string(source)
                variables = frozenset(
                    jinja2.meta.find_undeclared_variables(self._env.parse(source))
                )
            except jinja2.TemplateError as e:
                raise _error(f"the chat template does not compile: {e}") from None
            developer = '"developer"' in source or "'developer'" in source
            fmt = self._forced_format or detect_content_format(self._env, source)
            hit = (compiled, variables, developer, fmt)
            self._templates[source] = hit
        return hit

    # ------------------------------------------------------------------------ normalisation
    def _content_parts(
        self, role: str, content: Any, i: int, fmt: ContentFormat
    ) -> str | list[dict[str, Any]]:
        """vllm.renderers.chat_utils.parse_chat_message_content(_parts): text parts kept
        (empty ones dropped), joined with "\\n" for string-format templates."""
        param = f"messages.{i}.content"
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise _error(
                f"messages[{i}].content must be a string or a list of content parts", param
            )
        if role == "system":
            parts = self._strip_billing_header(parts)
        texts: list[Any] = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict):
                raise _error(f"messages[{i}].content[{j}] must be an object", param)
            ptype = part.get("type")
            if ptype is None:
                if any(k in part for k in _MEDIA_KEYS):
                    raise _error("the served model is not multimodal", param)
                raise _error("Missing 'type' field in multimodal part.", param)
            if not isinstance(ptype, str):
                raise _error("Invalid 'type' field in multimodal part.", param)
            if ptype in _TEXT_PARTS:
                text = part.get(_TEXT_PARTS[ptype])
                if text is None:
                    continue  # vLLM skips a text part with no text
                if not isinstance(text, str):
                    raise _error(
                        f"messages[{i}].content[{j}].{_TEXT_PARTS[ptype]} must be a string", param
                    )
                if fmt == "openai":  # a dict part, kept even when its text is empty
                    extra = {
                        k: _plain(v)
                        for k, v in part.items()
                        if k not in ("type", "text", "refusal", "thinking", "closed")
                    }
                    texts.append({"type": "text", "text": text, **extra})
                elif text:  # vLLM drops empty strings
                    texts.append(text)
            elif ptype == "tool_reference":
                name = part.get("name")
                if name:
                    texts.append(
                        {"type": "tool_reference", "name": name} if fmt == "openai" else str(name)
                    )
            elif ptype in _MEDIA_PARTS or any(k in part for k in _MEDIA_KEYS):
                raise _error(
                    "the served model is not multimodal: only text content parts are supported",
                    param,
                )
            else:
                raise _error(f"Unsupported chat content part type: {ptype!r}.", param)
        if fmt == "openai":
            if role == "tool" and all(
                isinstance(t, dict) and t.get("type") == "text" for t in texts
            ):
                return "\n".join(t["text"] for t in texts)
            return texts
        return "\n".join(texts)

    @staticmethod
    def _strip_billing_header(parts: list[Any]) -> list[Any]:
        """Drop Claude Code's ``x-anthropic-billing-header`` first line from system text parts
        (its value changes every request and would break the prefix)."""
        out: list[Any] = []
        for part in parts:
            text = (
                part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            )
            if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
                out.append(part)
                continue
            rest = text.partition("\n")[2]
            if rest:
                out.append({**part, "text": rest})
        return out

    def _tool_calls(self, calls: Any, i: int) -> list[dict[str, Any]] | None:
        """Assistant tool_calls as the template gets them: arguments parsed to a dict
        (invalid JSON or a non-object -> {})."""
        param = f"messages.{i}.tool_calls"
        if calls is None:
            return None
        if not isinstance(calls, list):
            raise _error(f"messages[{i}].tool_calls must be a list", param)
        out = []
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                raise _error("assistant tool_calls entries must be objects.", param)
            fn = call.get("function")
            if call.get("type") != "function" or not isinstance(fn, dict):
                raise _error(
                    "chat completions only support assistant tool_calls of type 'function'.", param
                )
            if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                raise _error(
                    f"messages[{i}].tool_calls[{j}].function needs a string name and "
                    "string arguments",
                    param,
                )
            if not isinstance(call.get("id"), str):
                raise _error(
                    f"messages[{i}].tool_calls[{j}].id is required and must be a string", param
                )
            args: Any = fn["arguments"]
            if args:
                try:
                    args = json.loads(args)
                except (json.JSONDecodeError, RecursionError):
                    args = {}
                if not isinstance(args, dict):
                    args = {}
            else:
                args = {}
            item = {k: _plain(v) for k, v in call.items() if k != "function"}
            item["function"] = {**{k: _plain(v) for k, v in fn.items()}, "arguments": args}
            out.append(item)
        return out

    def _conversation(self, messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
        if not isinstance(messages, list):
            raise _error("'messages' must be a list of messages", "messages")
        conv: list[dict[str, Any]] = []
        budget = self.max_prompt_chars
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise _error(f"messages[{i}] must be an object", "messages")
            role = msg.get("role")
            if not isinstance(role, str):
                raise _error(
                    f"messages[{i}].role is required and must be a string", f"messages.{i}.role"
                )
            content = msg.get("content")
            if content is None and "content" in msg and role not in _NULL_CONTENT_ROLES:
                # absent content renders as "", but an explicit null is rejected
                raise _error(
                    f"messages[{i}].content must be a string or a list of content parts, "
                    f"not null, for role {role!r}",
                    f"messages.{i}.content",
                )
            name = msg.get("name")
            if "name" in msg and not isinstance(name, str):
                raise _error(f"messages[{i}].name must be a string", f"messages.{i}.name")
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")  # vLLM renames it to "reasoning"
            if role == "assistant" and reasoning is not None and not isinstance(reasoning, str):
                raise _error(f"messages[{i}].reasoning must be a string", f"messages.{i}.reasoning")
            out: dict[str, Any] = {
                "role": role,
                "content": self._content_parts(role, content, i, fmt),
            }
            if isinstance(out["content"], str):
                budget -= len(out["content"])
            if role == "assistant":
                calls = self._tool_calls(msg.get("tool_calls"), i)
                if calls:  # an empty list is dropped
                    out["tool_calls"] = calls
                if reasoning is not None:
                    out["reasoning"] = reasoning
                    out["reasoning_content"] = reasoning
                    budget -= len(reasoning)
            elif role == "tool" and "tool_call_id" in msg:
                tcid = msg["tool_call_id"]
                if tcid is not None and not isinstance(tcid, str):
                    raise _error(
                        f"messages[{i}].tool_call_id must be a string", f"messages.{i}.tool_call_id"
                    )
                out["tool_call_id"] = tcid
            if isinstance(name, str):
                out["name"] = name
            task = msg.get("task")
            if isinstance(task, str):
                out["task"] = task
            if role == "developer":
                out["tools"] = _plain(msg.get("tools"))
            if budget < 0:
                raise self._too_long()
            conv.append(out)
        return conv

    @staticmethod
    def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """vllm.renderers.hf: developer -> system, then every system message merged into one
        at position 0 (joined with a blank line) if any is not first or there are several."""
        conv = [
            {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
            if m["role"] == "developer"
            else m
            for m in conv
        ]
        contents: list[str] = []
        rest: list[dict[str, Any]] = []
        merge = False
        for i, m in enumerate(conv):
            if m["role"] == "system":
                if i > 0 or contents:
                    merge = True
                content = m.get("content", "")
                if isinstance(content, list):
                    content = "\n".join(
                        p["text"] if isinstance(p, dict) else p
                        for p in content
                        if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
                    )
                if content:
                    contents.append(content)
            else:
                rest.append(m)
        if not merge:
            return conv
        return [{"role": "system", "content": "\n\n".join(contents)}, *rest]

    def _tools(self, body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """Tools as vLLM's ChatCompletionToolsParam(...).model_dump() gives them: key order
        type, function{name, description, parameters[, strict][, defer_loading]}
        [, defer_loading]; unknown keys dropped; missing description/parameters -> null."""
        tools = body.get("tools")
        if tools is None or tools == []:
            return None
        if not isinstance(tools, list):
            raise _error("'tools' must be a list", "tools")
        out = []
        for j, tool in enumerate(tools):
            param = f"tools.{j}"
            if not isinstance(tool, dict):
                raise _error(f"tools[{j}] must be an object", param)
            if tool.get("type", "function") != "function":
                raise _error(f"tools[{j}].type must be 'function'", param)
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise _error(f"tools[{j}].function must be an object", param)
            name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters")
            strict = fn.get("strict")
            defer = tool.get("defer_loading")
            fn_defer = fn.get("defer_loading")
            if not isinstance(name, str):
                raise _error(
                    f"tools[{j}].function.name is required and must be a string",
                    f"{param}.function.name",
                )
            if desc is not None and not isinstance(desc, str):
                raise _error(f"tools[{j}].function.description must be a string", param)
            if params is not None and not isinstance(params, dict):
                raise _error(f"tools[{j}].function.parameters must be an object", param)
            flags = []
            for key, flag in (
                ("strict", strict),
                ("defer_loading", fn_defer),
                ("defer_loading", defer),
            ):
                value = None if flag is None else _lax_bool(flag)
                if flag is not None and value is None:
                    raise _error(f"tools[{j}] {key} must be a boolean", param)
                flags.append(value)
            strict, fn_defer, defer = flags
            if defer is not None and fn_defer is None:
                fn_defer = defer
            function: dict[str, Any] = {
                "name": name,
                "description": desc,
                "parameters": _plain(params),
            }
            if strict is not None:
                function["strict"] = strict
            if fn_defer is not None:
                function["defer_loading"] = fn_defer
            dumped: dict[str, Any] = {"type": "function", "function": function}
            if defer is not None:
                dumped["defer_loading"] = defer
            out.append(dumped)
        return out

    @staticmethod
    def _check_tool_choice(body: Mapping[str, Any]) -> None:
        """The parts of vLLM's check_tool_usage that reject a request."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if tools == [] and not isinstance(choice, dict):
            tools = None
            if choice in ("auto", "required"):
                choice = "none"
        if choice is None or choice == "none":
            return
        if tools is None:
            raise _error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name:
                raise _error(
                    "tool_choice must name a function: "
                    '{"type": "function", "function": {"name": "my_function"}}',
                    "tool_choice.function.name",
                )
            if not any(
                isinstance(t, dict)
                and isinstance(t.get("function"), dict)
                and t["function"].get("name") == name
                for t in tools
            ):
                raise _error(
                    f"The tool `{name}` specified in `tool_choice` does not match any "
                    "of the specified `tools`",
                    "tool_choice",
                )
        elif choice not in ("auto", "required"):
            raise _error(
                f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                '"none", "auto" or "required" are supported.',
                "tool_choice",
            )

    def _chat_kwargs(
        self, body: Mapping[str, Any], add_generation_prompt: bool, continue_final_message: bool
    ) -> dict[str, Any]:
        """The chat_template kwargs vLLM ends up passing (ChatCompletionRequest.
        build_chat_params + preprocess_chat's defaults + merge_kwargs' unset rule)."""
        user = body.get("chat_template_kwargs")
        if user is None:
            user = {}
        if not isinstance(user, dict):
            raise _error("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        if user.get("chat_template") is not None or body.get("chat_template") is not None:
            raise _error(
                "Chat template is passed with request, but "
                "--trust-request-chat-template is not set. Refused request with "
                "untrusted chat template.",
                "chat_template",
            )
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in _REASONING_EFFORTS:
            raise _error(
                "'reasoning_effort' must be one of " + ", ".join(_REASONING_EFFORTS),
                "reasoning_effort",
            )
        documents = body.get("documents")
        if documents is not None and not (
            isinstance(documents, list)
            and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents
            )
        ):
            raise _error("'documents' must be a list of objects with string values", "documents")
        extra: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "documents": documents,
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        merged = dict(user)
        merged.update({k: v for k, v in extra.items() if v not in _UNSET})
        # ChatParams.with_defaults: the server's --default-chat-template-kwargs, overridden
        # by the request's (unset values do not override)
        out = dict(self.default_chat_template_kwargs)
        out.update({k: v for k, v in merged.items() if v not in _UNSET})
        return out

    def normalize_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs vLLM hands the chat template for this body: ``{"conversation",
        "tools", "template_kwargs", "add_generation_prompt", "continue_final_message",
        "add_special_tokens"}``. Raises APIError(400) on what vLLM rejects."""
        if not isinstance(body, Mapping):
            raise _error("the request body must be a JSON object")
        validate_cache_salt(body.get("cache_salt"))
        agp = _bool_field(body, "add_generation_prompt", True)
        cfm = _bool_field(body, "continue_final_message", False)
        if agp and cfm:
            raise _error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        add_special = _bool_field(body, "add_special_tokens", False)
        self._check_mm_kwargs(body)
        kwargs = self._chat_kwargs(body, agp, cfm)
        self._check_tool_choice(body)
        tools = self._tools(body)
        if "tools" in kwargs:  # a chat_template_kwargs "tools" replaces the request's
            tools = _plain(kwargs["tools"])
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise _error("Tools should be a list of JSON schemas", "chat_template_kwargs")
        _, variables, developer, fmt = self._template(tools)
        conv = self._conversation(body.get("messages"), fmt)
        if not conv:
            raise _error(
                "Cannot apply chat template to an empty conversation. Provide at "
                "least one message.",
                "messages",
            )
        if not developer and any(m["role"] == "developer" for m in conv):
            conv = self._developer_to_system(conv)
        # resolve_chat_template_kwargs: keep what the template or apply_chat_template knows
        accepted = (variables | _HF_CHAT_PARAMS) - {"chat_template", "tokenize"}
        for k in kwargs:
            if k in _COLLIDING_KWARGS_ANY:
                raise _error(f"chat_template_kwargs may not set {k!r}", "chat_template_kwargs")
        kept = {k: v for k, v in kwargs.items() if k in accepted and k != "tools"}
        for k in kept:
            if k in _COLLIDING_KWARGS:
                raise _error(f"chat_template_kwargs may not set {k!r}", "chat_template_kwargs")
        if kept.get("return_assistant_tokens_mask"):
            raise _error(
                "`return_assistant_tokens_mask=True` requires `return_dict=True` and "
                "`tokenize=True`",
                "chat_template_kwargs",
            )
        if kept.get("sanitize_control_tokens"):
            raise _error(
                "`sanitize_control_tokens=True` requires `tokenize=True`", "chat_template_kwargs"
            )
        docs = kept.pop("documents", None)
        if docs is not None and not (
            isinstance(docs, list) and all(isinstance(d, dict) for d in docs)
        ):
            raise _error(
                "Documents should be a list of dicts with 'title' and 'text' keys!", "documents"
            )
        for k in (
            "add_generation_prompt",
            "continue_final_message",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "tokenizer_kwargs",
            "return_assistant_tokens_mask",
            "sanitize_control_tokens",
        ):
            kept.pop(k, None)
        template_kwargs = {**self._special_tokens_map, **_plain(kept)}
        return {
            "conversation": conv,
            "tools": tools,
            "documents": _plain(docs),
            "template_kwargs": template_kwargs,
            "add_generation_prompt": agp,
            "continue_final_message": cfm,
            "add_special_tokens": add_special,
        }

    # ---------------------------------------------------------------------------- rendering
    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt string vLLM renders for an OpenAI chat request body."""
        return self._render(self.normalize_chat(body))

    def _render(self, norm: dict[str, Any]) -> str:
        """transformers' render_jinja_template (5.22), for one conversation."""
        compiled = self._template(norm["tools"])[0]
        chat = [dict(m) for m in norm["conversation"]]
        for n, m in enumerate(chat):  # _alias_reasoning_fields
            r = next(
                (
                    m[k]
                    for k in ("reasoning_content", "thinking", "reasoning")
                    if m.get(k) is not None
                ),
                None,
            )
            if r is not None:
                chat[n] = {"thinking": r, **m, "reasoning_content": r}
        cfm = norm["continue_final_message"]
        final = None
        if cfm:
            final = chat[-1].get("content")
            if final is None:
                raise _error(
                    "continue_final_message is set but the final message has no "
                    '"content" to continue!',
                    "continue_final_message",
                )
            source = self._template_source_for(norm["tools"])
            if "content" not in source:
                raise _error(
                    'continue_final_message is set to "content" but this is not an '
                    "accepted field in the chat_template",
                    "continue_final_message",
                )
            if isinstance(final, list):
                final = [dict(b) if isinstance(b, dict) else b for b in final]
                chat[-1]["content"] = final
                for block in reversed(final):
                    if isinstance(block, dict) and "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise _error(
                        "continue_final_message is set but we could not find any "
                        "text to continue in the final message!",
                        "continue_final_message",
                    )
            else:
                chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            text = compiled.render(
                messages=chat,
                tools=norm["tools"],
                documents=norm["documents"],
                add_generation_prompt=norm["add_generation_prompt"],
                **norm["template_kwargs"],
            )
        except APIError:
            raise
        except Exception as e:  # never a 500: the template rejected this input
            raise _error(
                f"the chat template rejected the request: {_template_error_reason(e)}", "messages"
            ) from None
        if cfm:
            assert isinstance(final, str)
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise _error(
                    "continue_final_message is set but the final message does not "
                    "appear in the chat after applying the chat template!",
                    "continue_final_message",
                )
            loc = text.rindex(_CONTINUE_TAG.strip())
            if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:loc]
            else:
                text = text[:loc].rstrip()
        if len(text) > self.max_prompt_chars:
            raise self._too_long(len(text))
        return text

    def _template_source_for(self, tools: Any) -> str:
        source = self._template_source
        if isinstance(source, dict):
            source = (
                source.get("tool_use")
                if tools is not None and "tool_use" in source
                else source.get("default")
            )
        return source if isinstance(source, str) else ""

    def _too_long(self, n: int | None = None) -> APIError:
        got = f" ({n} characters)" if n is not None else ""
        return APIError(
            400,
            f"the prompt is too long{got}: at most {self.max_prompt_chars} characters are accepted",
            param="messages",
            code="prompt_too_long",
        )

    # ------------------------------------------------------------------------- tokenizing
    @contextlib.contextmanager
    def inline(self, max_uncached_chars: int) -> Iterator[None]:
        """Within this block, tokenizing raises ``NeedsThread`` instead of BPE-encoding more
        than ``max_uncached_chars`` of uncached text, so an event loop can tokenize a cached
        prompt in place (microseconds) and hand only real work to a thread."""
        token = _INLINE_BUDGET.set(max_uncached_chars)
        try:
            yield
        finally:
            _INLINE_BUDGET.reset(token)

    @contextlib.contextmanager
    def cache_scope(self, cache_salt: str | None) -> Iterator[None]:
        """Within this block, segment-cache entries are those of the ``cache_salt`` scope:
        text cached under another salt is a miss here, exactly as on a replica."""
        token = _CACHE_SCOPE.set(cache_scope_seed(cache_salt))
        try:
            yield
        finally:
            _CACHE_SCOPE.reset(token)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``, through the segment cache when
        it is on and provably equivalent."""
        return _as_list(self._encode(text, add_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool) -> TokenIds:
        if self.segment_cache and (not add_special_tokens or self._special_adds_nothing):
            return self._encode_segments(text)
        return self._encode_whole(text, add_special_tokens)

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # lone surrogates cannot be turned into UTF-8
            raise _error("the prompt is not valid Unicode text") from None

    def _segment_split_safe(self) -> str | None:
        """None if tokenizing segment by segment is exactly the whole-text tokenization for
        this tokenizer, else the reason it is not."""
        backend = self._backend
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return "not a fast (Rust) tokenizer"
        for tid, tok in backend.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
                return f"added token {tok.content!r} has lstrip/rstrip/single_word/normalized"
            if not tok.content:
                return "empty added token"
            self._added[tok.content] = tid
        if getattr(self.tokenizer, "split_special_tokens", False):
            return "split_special_tokens is set"
        spec: dict[str, Any] = {}
        try:
            for key in ("normalizer", "pre_tokenizer"):
                component = getattr(backend, key, None)
                spec[key] = None if component is None else json.loads(component.__getstate__())
        except Exception:
            return "cannot inspect the tokenizer"

        # Pre-tokenizers/normalizers that look at where the *whole* text starts (a prefix
        # space, Metaspace "first") would treat each segment as a start.
        def walk(node: Any) -> Iterator[Any]:
            if isinstance(node, dict):
                yield node
                for v in node.values():
                    yield from walk(v)
            elif isinstance(node, list):
                for v in node:
                    yield from walk(v)

        for key in ("normalizer", "pre_tokenizer"):
            for node in walk(spec.get(key)):
                if node.get("add_prefix_space") or node.get("prepend_scheme") not in (
                    None,
                    "never",
                ):
                    return f"{key} depends on the start of the text"
                if node.get("type") in ("Prepend",):
                    return f"{key} prepends text"
        if not self._added:
            return "no added tokens to split on"
        alternatives = sorted(self._added, key=len, reverse=True)  # leftmost-longest
        self._split_re = re.compile("|".join(re.escape(t) for t in alternatives))
        # add_special_tokens=True can use the segment path only if it adds nothing.
        probe = "a<|probe|> b\n"
        self._special_adds_nothing = (
            backend.encode(probe, add_special_tokens=True).ids
            == backend.encode(probe, add_special_tokens=False).ids
        )
        # Self-check on text that crosses every kind of boundary.
        sample = "".join(f"x {t}\n {t}é\u0301 " for t in alternatives) + "  end"
        if list(self._encode_split(sample, use_cache=False)) != list(
            backend.encode(sample, add_special_tokens=False).ids
        ):
            return "segment tokenization differs from whole-text tokenization"
        return None

    def _encode_segments(self, text: str) -> array[int]:
        return self._encode_split(text, use_cache=True)

    def _encode_split(self, text: str, *, use_cache: bool) -> array[int]:
        assert self._split_re is not None and self._backend is not None
        added = self._added
        pieces: list[str | int] = []  # segment text, or an added token's id
        pos = 0
        for m in self._split_re.finditer(text):
            if m.start() > pos:
                pieces.append(text[pos : m.start()])
            pieces.append(added[m.group()])
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        keys: list[int] = []
        found: dict[int, Sequence[int]] = {}
        missing: dict[int, str] = {}
        cache = self._cache
        seed = _CACHE_SCOPE.get()
        for p in pieces:
            if isinstance(p, int):
                continue
            try:
                key = xxhash.xxh3_128_intdigest(p.encode("utf-8"), seed)
            except UnicodeEncodeError:
                raise _error("the prompt is not valid Unicode text") from None
            keys.append(key)
            if key in found or key in missing:
                continue
            hit = cache.get(key) if use_cache else None
            if hit is not None:
                found[key] = hit
            else:
                missing[key] = p
        if use_cache and found:
            with self._cache_lock:
                for key in found:
                    if key in cache:
                        cache.move_to_end(key)
                self.cache_hits += len(found)
        if missing:
            budget = _INLINE_BUDGET.get()
            if budget is not None and sum(map(len, missing.values())) > budget:
                raise NeedsThread
            segs = list(missing.values())
            encs = (
                self._backend.encode_batch_fast(segs, add_special_tokens=False)
                if len(segs) > 1
                else [self._backend.encode(segs[0], add_special_tokens=False)]
            )
            for key, enc in zip(missing, encs, strict=True):
                ids = enc.ids
                found[key] = ids
                if use_cache:
                    self._cache_put(key, ids)
            if use_cache:
                self.cache_misses += len(missing)
        out = array("I")  # cached segments are arrays: extending copies memory, not ints
        k = 0
        for p in pieces:
            if isinstance(p, int):
                out.append(p)
            else:
                out.extend(found[keys[k]])
                k += 1
        return out  # an array all the way to block hashing: no Python int per token

    def _cache_put(self, key: int, ids: list[int]) -> None:
        n = len(ids)
        if n == 0 or n > self.segment_cache_tokens // 4:  # one segment may not flush the cache
            return
        stored = array("I", ids)
        with self._cache_lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cache_tokens -= len(old)
            self._cache[key] = stored
            self._cache_tokens += n
            while self._cache_tokens > self.segment_cache_tokens and self._cache:
                _, evicted = self._cache.popitem(last=False)
                self._cache_tokens -= len(evicted)

    def cache_info(self) -> dict[str, int]:
        """Segment-cache counters (entries, cached tokens, budget, hits, misses)."""
        return {
            "entries": len(self._cache),
            "tokens": self._cache_tokens,
            "max_tokens": self.segment_cache_tokens,
            "hits": self.cache_hits,
            "misses": self.cache_misses,
        }

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._cache_tokens = 0

    # ------------------------------------------------------------ vLLM's TokenizeParams
    def _tokenize_text(
        self, text: str, add_special_tokens: bool, trunc: _Truncation, param: str
    ) -> TokenIds:
        max_len = self.max_model_len
        if (
            max_len is not None
            and trunc.tokens is None
            and len(text) > max_len * self._max_chars_per_token()
        ):
            raise _error(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"your prompt contains {len(text)} characters.",
                "input_text",
            )
        if len(text) > self.max_prompt_chars:
            raise self._too_long(len(text))
        return self._post_tokenize(self._encode(text, add_special_tokens), trunc, param)

    def _max_chars_per_token(self) -> int:
        """vLLM's ``max_chars_per_token``: the longest token string in the vocabulary."""
        if self._max_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_chars = max((len(t) for t in vocab), default=1)
        return self._max_chars

    def _post_tokenize(self, ids: TokenIds, trunc: _Truncation, param: str) -> TokenIds:
        max_len = self.max_model_len
        keep = trunc.tokens
        out_tokens = trunc.max_output_tokens
        if max_len is not None and isinstance(out_tokens, int) and out_tokens > max_len:
            raise _error(
                f"max_tokens={out_tokens} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        if max_len is not None and keep is not None and keep > max_len:
            raise _error(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{max_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if keep is not None and keep < 0:
            keep = (
                None
                if max_len is None
                else (max_len if trunc.max_output_tokens == 0 else max(0, max_len - 1))
            )
        if keep is not None and keep < len(ids):
            side = trunc.side or self.truncation_side
            ids = [] if keep == 0 else (ids[-keep:] if side == "left" else ids[:keep])
        if max_len is not None and len(ids) > max_len:
            raise _error(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens.",
                "input_tokens",
            )
        if not ids:
            raise _error("No token_ids rendered", param)
        return ids

    def tokenize_chat(self, body: dict[str, Any]) -> list[int]:
        """vLLM's prompt token ids for an OpenAI chat request body."""
        return _as_list(self.chat_ids(body))

    def chat_ids(self, body: dict[str, Any]) -> TokenIds:
        """``tokenize_chat`` as the gateway wants it: an ``array('I')`` on the segment-cache
        path (a list of 4,000 Python ints costs ~0.1 ms to build and as much to pack)."""
        norm = self.normalize_chat(body)
        reused = self._reused_prompt_token_ids(body)
        if reused is not None:
            return reused
        text = self._render(norm)
        return self._tokenize_text(
            text, norm["add_special_tokens"], _Truncation(body, chat=True), "messages"
        )

    def _reused_prompt_token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """Disaggregated serving: vLLM takes ``kv_transfer_params.prompt_token_ids`` as the
        prompt (no rendering, no truncation) unless ``echo`` is set."""
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
            return None
        if _lax_bool(body.get("echo", False)):
            return None
        ids = kv["prompt_token_ids"]
        param = "kv_transfer_params.prompt_token_ids"
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise _error(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                "non-negative integers.",
                param,
            )
        bad = max(ids)
        if bad >= self.vocab_size:
            raise _error(f"Token id {bad} is out of vocabulary", param)
        return list(ids)

    def _check_mm_kwargs(self, body: Mapping[str, Any]) -> None:
        if self.trust_request_mm_kwargs:
            return
        for key in ("mm_processor_kwargs", "media_io_kwargs"):
            if body.get(key):
                raise _error(
                    f"Per-request {key} are disabled by default (vLLM: start the server with "
                    "--trust-request-mm-kwargs)",
                    key,
                )

    async def tokenize_chat_async(
        self, body: dict[str, Any], *, inline_below_chars: int = 16384
    ) -> list[int]:
        """``tokenize_chat`` off the event loop when the body's text is long (a thread hop
        costs more than tokenizing a short prompt)."""
        if _text_size(body.get("messages"), inline_below_chars) < inline_below_chars:
            return self.tokenize_chat(body)
        return await asyncio.to_thread(self.tokenize_chat, body)

    # -------------------------------------------------------------------------- completions
    def tokenize_completion_batch(
        self, prompt: Any, *, add_special_tokens: bool = True, body: Mapping[str, Any] | None = None
    ) -> list[list[int]]:
        """Token ids of each prompt of a completions request, as vLLM's prompt_to_seq sees it:
        a string or a list of ints is one prompt; a list of strings / of int lists is several.
        ``body`` supplies truncate_prompt_tokens / truncation_side / max_tokens."""
        return [
            _as_list(ids) for ids in self._completion_batch_ids(prompt, add_special_tokens, body)
        ]

    def _completion_batch_ids(
        self, prompt: Any, add_special_tokens: bool, body: Mapping[str, Any] | None
    ) -> list[TokenIds]:
        trunc = _Truncation(body or {}, chat=False)
        if prompt is None or prompt == "":
            raise _error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [self._tokenize_text(prompt, add_special_tokens, trunc, "prompt")]
        if not isinstance(prompt, list):
            raise _error(
                "prompt must be a string, a list of strings, a list of token ids or "
                "a list of token-id lists",
                "prompt",
            )
        if not prompt:
            raise _error("You must pass at least one prompt", "prompt")
        as_ids = self._token_ids(prompt)
        if as_ids is not None:
            return [self._post_tokenize(as_ids, trunc, "prompt")]
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise _error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count "
                f"of {MAX_COMPLETION_PROMPTS}.",
                "prompt",
            )
        if all(isinstance(p, str) for p in prompt):
            total = sum(len(p) for p in prompt)
            if total > self.max_prompt_chars:
                raise self._too_long(total)
            return [self._tokenize_text(p, add_special_tokens, trunc, "prompt") for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            out = []
            for p in prompt:
                ids = self._token_ids(p) if p else []
                if ids is None:
                    raise _error(
                        "each prompt must be a list of non-negative integer token ids", "prompt"
                    )
                out.append(self._post_tokenize(ids, trunc, "prompt"))
            return out
        raise _error(
            "prompt must be a string, a list of strings, a list of token ids or a "
            "list of token-id lists (not a mix)",
            "prompt",
        )

    def _token_ids(self, prompt: list[Any]) -> list[int] | None:
        # Fast path for the common case, plain JSON integers in range: C-speed scans only.
        if (
            prompt
            and all(type(t) is int for t in prompt)
            and min(prompt) >= 0
            and max(prompt) < self.vocab_size
        ):
            return list(prompt)
        ids = []
        for t in prompt:
            v = _as_token_id(t)
            if v is None:
                return None
            ids.append(v)
        if not ids:
            return None
        bad = next((v for v in ids if v < 0 or v >= self.vocab_size), None)
        if bad is not None:
            raise _error(f"Token id {bad} is out of vocabulary", "prompt")
        return ids

    def tokenize_completion(self, prompt: str | Sequence[int] | Sequence[Any]) -> list[int]:
        """Token ids of a completions prompt. With several prompts (a list of strings or of
        id lists) this is the FIRST one's ids - what the router routes on; use
        ``tokenize_completion_batch`` for all of them."""
        return self.tokenize_completion_batch(
            list(prompt) if isinstance(prompt, tuple) else prompt
        )[0]

    def tokenize_completion_request(self, body: Mapping[str, Any]) -> list[list[int]]:
        """All prompts of a completions request body, honouring add_special_tokens,
        truncate_prompt_tokens, truncation_side and cache_salt validation."""
        return [_as_list(ids) for ids in self.completion_request_ids(body)]

    def completion_request_ids(self, body: Mapping[str, Any]) -> list[TokenIds]:
        """``tokenize_completion_request`` with arrays where they are cheaper (``chat_ids``)."""
        if not isinstance(body, Mapping):
            raise _error("the request body must be a JSON object")
        validate_cache_salt(body.get("cache_salt"))
        self._check_mm_kwargs(body)
        if body.get("suffix") is not None:
            raise _error(
                "suffix is only supported for models with FIM completion rendering", "suffix"
            )
        return self._completion_batch_ids(
            body.get("prompt"), _bool_field(body, "add_special_tokens", True), body
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))


def _as_list(ids: TokenIds) -> list[int]:
    if isinstance(ids, list):
        return ids
    return ids.tolist() if isinstance(ids, array) else list(ids)


def _text_size(value: Any, limit: int) -> int:
    """Characters of text in a JSON value, counting up to about ``limit``."""
    total = 0
    stack = [value]
    while stack and total < limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total
