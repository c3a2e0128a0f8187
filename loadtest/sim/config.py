"""What one simulated replica serves and how fast: ``SimConfig`` (every field is a flag of
``python -m loadtest.replica``; see ``loadtest.sim.cli``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.core.bundled import tokenizer_dir

DEFAULT_TOKENIZER = str(tokenizer_dir())
VLLM_VERSION = "0.34.0"


@dataclass
class SimConfig:
    model: str = "Qwen/Qwen3-0.6B"
    root: str | None = None  # the card's ``root`` (vLLM: the path or hub id loaded); None: model
    tokenizer: str = DEFAULT_TOKENIZER
    # vLLM's --chat-template: a file's path or the template text (None: the tokenizer's own).
    chat_template: str | None = None
    block_size: int = 16
    num_gpu_blocks: int = 4096  # finite pool, LRU eviction of free cached blocks
    # vLLM's OffloadingConnector with a CPU tier of this many blocks (0: none;
    # loadtest/sim/offload.py), and a loaded token's time in computed prompt tokens.
    cpu_offload_blocks: int = 0
    cpu_load_cost: float = 0.2
    prefill_tokens_per_s: float = 200_000.0  # uncached prompt tokens/s, one FIFO per replica
    decode_tokens_per_s: float = 2_000.0  # per running sequence
    # Replica time one output token takes from prefill, in prefill tokens (vLLM batches decode
    # and prefill in one step): a request's decode delays the prefills queued after it.
    decode_cost_tokens: float = 0.0
    request_overhead_s: float = 0.0005  # fixed, per request, before the first token
    max_tokens_default: int = 16  # when the request gives no max_tokens/max_completion_tokens
    max_num_seqs: int = 256
    max_model_len: int = 40960
    lora_adapters: list[str] = field(default_factory=list)  # extra cards, parent = model
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
    allow_runtime_lora: bool = False
    lora_load_s: float = 0.0  # how long a runtime load takes (vLLM reads the weights first)
    # Paths where no adapter is found: loading from one answers vLLM's 404 (NotFoundError).
    lora_missing_paths: list[str] = field(default_factory=list)
    enable_prompt_tokens_details: bool = True
    # vLLM attaches prompt_tokens_details only when cached_tokens > 0 (null / absent on a
    # miss); True reports {"cached_tokens": 0} on a miss too.
    # vLLM 0.34 reports {cached_tokens: 0} on a miss; older releases sent null there.
    always_report_cached_tokens: bool = True
    # vLLM's --enable-force-include-usage: every stream ends with a usage chunk (and carries
    # usage on every chunk) whether or not the request asked with stream_options.
    enable_force_include_usage: bool = False
    instant: bool = False  # all timing zero (overhead benchmarks)
    seed: int = 0
    # vLLM's --kv-events-config: publish KV cache events (ZMQ PUB, bound here; None = off),
    # with a ROUTER replay socket when replay is set. tcp://127.0.0.1:* picks a free port.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    # vLLM's --kv-transfer-config with NixlConnector (pull mode, kv_role kv_both): the replica
    # serves the prefill leg (kv_transfer_params.do_remote_decode: pins its blocks for D) and
    # the decode leg (do_remote_prefill: pulls the blocks it lacks from P). None: no connector
    # (kv_transfer_params are ignored and answered null, as vLLM without one).
    kv_connector: str | None = None
    # VLLM_NIXL_SIDE_CHANNEL_HOST (vLLM's default: localhost). The simulator's side channel is
    # its HTTP port (POST /_sim/nixl), so remote_port is that port.
    nixl_side_channel_host: str = "localhost"
    kv_lease_s: float = 30.0  # kv_lease_duration: how long P pins a request's blocks for D
    kv_handshake_s: float = 0.05  # first contact of a decode engine with a prefill engine
    # Time to pull one KV block over D's link (shared by its concurrent pulls, one FIFO): ~2 MB
    # a 16-token block of an 8B model at ~25 GB/s.
    kv_block_transfer_s: float = 0.0001
    # kv_load_failure_policy: "fail" (vLLM's default: the request ends with an error) or
    # "recompute" (D computes the prompt itself).
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "num_gpu_blocks",
            "max_tokens_default",
            "max_num_seqs",
            "max_model_len",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SimConfig.{name} must be a positive integer, got {v!r}")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"SimConfig.{name} must be a positive number, got {v!r}")
        v = self.decode_cost_tokens
        if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
            raise ValueError(f"SimConfig.decode_cost_tokens must be >= 0, got {v!r}")
        if not (
            isinstance(self.request_overhead_s, (int, float))
            and 0 <= self.request_overhead_s < math.inf
        ):
            raise ValueError("SimConfig.request_overhead_s must be >= 0")
        self.lora_adapters = list(self.lora_adapters)
        if self.kv_connector not in (None, "NixlConnector"):
            raise ValueError(
                f"SimConfig.kv_connector: only NixlConnector is simulated, got {self.kv_connector!r}"
            )
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError("SimConfig.kv_load_failure_policy must be 'fail' or 'recompute'")
        v = self.cpu_offload_blocks
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"SimConfig.cpu_offload_blocks must be >= 0, got {v!r}")
        for name in ("kv_lease_s", "kv_handshake_s", "kv_block_transfer_s", "cpu_load_cost"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
                raise ValueError(f"SimConfig.{name} must be >= 0, got {v!r}")
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot have the base model's name")
