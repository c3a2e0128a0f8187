"""The shapes every workload is made of (a :class:`Workload` of :class:`Session` scripts that
yield :class:`RequestSpec` turns), shared by ``loadtest.workloads``, ``loadtest.trace`` and the
runner. Kept apart so the trace replay and the synthetic workloads do not import each other."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

Endpoint = Literal["chat", "completions", "messages"]  # messages: Anthropic's API


@dataclass
class RequestSpec:
    """One request a session wants to send.

    ``body`` is the OpenAI request body (without ``stream``/``stream_options``, which the runner
    sets). Token-id workloads build the body lazily (``body_fn``) so a long replay does not
    hold every prompt in memory; ``token_ids_fn`` returns the prompt's token ids when they are
    known without tokenizing (token-id prompts). ``delay_s`` is how long to wait before
    sending: after the previous turn's answer (think time) or, for the first turn, after the
    session's arrival."""

    endpoint: Endpoint
    group: str
    session: str
    turn: int
    body: dict[str, Any] | None = None
    body_fn: Callable[[], dict[str, Any]] | None = None
    token_ids_fn: Callable[[], list[int]] | None = None
    delay_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the tenant's Authorization

    def make_body(self) -> dict[str, Any]:
        if self.body is not None:
            return self.body
        if self.body_fn is None:
            raise ValueError("RequestSpec has neither body nor body_fn")
        return self.body_fn()

    def prompt_token_ids(self, renderer: Any | None = None) -> list[int]:
        """The prompt's token ids: given for token-id prompts, else rendered and tokenized
        with ``renderer`` (a ``router.prompt.Renderer``) exactly as vLLM would."""
        if self.token_ids_fn is not None:
            return self.token_ids_fn()
        if renderer is None:
            raise ValueError("a renderer is needed to tokenize a chat request")
        body = self.make_body()
        if self.endpoint == "messages":  # rendered as the gateway and vLLM render it: as chat
            from router.api.anthropic import to_chat

            body, endpoint = to_chat(body), "chat"
        else:
            endpoint = self.endpoint
        if endpoint == "chat":  # the segment path where the renderer has one (same ids)
            return list(renderer.chat_ids(body))
        return list(renderer.tokenize_completion(body["prompt"]))


Script = Generator[RequestSpec, "str | None", None]


def one_shot(
    session: str,
    group: str,
    ids: Sequence[int],
    max_tokens: int,
    model: str,
    *,
    user: str | None = None,
    meta: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Callable[[], Script]:
    """A session of one token-id prompt on /v1/completions, ``max_tokens`` generated whatever
    the model samples (greedy, EOS ignored); ``user`` names the end user in the body."""
    ids = list(ids)

    def script() -> Script:
        body: dict[str, Any] = {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if user is not None:
            body["user"] = user
        yield RequestSpec(
            "completions",
            group=group,
            session=session,
            turn=0,
            body=body,
            token_ids_fn=lambda: ids,
            meta=dict(meta or {}),
            headers=dict(headers or {}),
        )

    return script


@dataclass
class Session:
    """A conversation (or a single request): arrives at ``start_s`` seconds into the run."""

    id: str
    group: str
    start_s: float
    script: Callable[[], Script]
    turns: int = 1


@dataclass
class Workload:
    name: str
    description: str
    sessions: list[Session]
    model: str = DEFAULT_MODEL
    params: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def planned_requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    def label(self) -> str:
        extra = self.params.get("position")
        return f"{self.name}/{extra}" if extra else self.name
