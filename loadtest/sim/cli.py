"""``prefix-router replica`` (also ``prefix-router loadtest sim`` and ``python -m
loadtest.replica``): simulated replicas on consecutive ports until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal

from loadtest.sim.config import DEFAULT_TOKENIZER, SimConfig
from loadtest.sim.server import SimReplica
from loadtest.sim.tokens import get_renderer, get_vllm_chat, get_words
from loadtest.sim.vllm_chat import load_chat_template
from router.ops.command_line import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    at_least,
    check_can_listen,
    check_port,
    check_tokenizer,
    listen_error,
    one_line,
    run,
)
from router.prompt import Renderer

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser(prog: str = "prefix-router replica") -> argparse.ArgumentParser:
    d = SimConfig.__dataclass_fields__
    p = OneLineParser(
        prog=prog,
        description="Run simulated vLLM replicas: vLLM's OpenAI-compatible API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /tokenize, "
        "/detokenize, /health, /version, /metrics) with vLLM's prefix cache and a "
        "prefill/decode timing model, no GPU. Prints 'ready http://HOST:PORT' per "
        "replica once listening; stops on SIGINT/SIGTERM.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=9001,
        help="port of the first replica (0: any free port for each)",
    )
    p.add_argument(
        "--count", type=int, default=1, help="number of replicas, on consecutive ports from --port"
    )
    p.add_argument("--model", default=d["model"].default, help="served model name")
    p.add_argument(
        "--root",
        default=None,
        help="the model card's root (vLLM: the path or hub id the model was loaded from; "
        "default: --model)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or Hugging Face model id (default: the bundled Qwen3 "
        "tokenizer, the one --model's default uses)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="vLLM's --chat-template: a template file or the template text (default: the "
        "tokenizer's own)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d["block_size"].default,
        help="tokens per KV block (the prefix-cache granularity)",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d["num_gpu_blocks"].default,
        help="KV blocks in the pool; free cached blocks are evicted LRU",
    )
    p.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=d["cpu_offload_blocks"].default,
        help="blocks of vLLM's CPU offload tier (OffloadingConnector; 0: none): prompt blocks "
        "are copied there, evicted LRU, loaded back after the GPU's hit, with KV events "
        "of medium CPU",
    )
    p.add_argument(
        "--cpu-load-cost",
        type=float,
        default=d["cpu_load_cost"].default,
        help="time to load one token from the CPU tier, in computed prompt tokens",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d["prefill_tokens_per_s"].default,
        help="uncached prompt tokens processed per second (one FIFO per replica)",
    )
    p.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=d["decode_tokens_per_s"].default,
        help="output tokens per second of each running request",
    )
    p.add_argument(
        "--decode-cost-tokens",
        type=float,
        default=d["decode_cost_tokens"].default,
        help="prefill tokens of replica time each output token takes (decode shares the "
        "steps, delaying the prefills queued behind it; 0: none)",
    )
    p.add_argument(
        "--request-overhead-s",
        type=float,
        default=d["request_overhead_s"].default,
        help="fixed time per request before its first token",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=d["max_tokens_default"].default,
        help="output tokens when a request sets no max_tokens",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d["max_num_seqs"].default,
        help="most requests admitted at once; the rest wait",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"].default,
        help="context length (prompt + output)",
    )
    p.add_argument(
        "--lora",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapter names served besides the base model",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    p.add_argument(
        "--lora-load-s",
        type=float,
        default=d["lora_load_s"].default,
        help="seconds a runtime LoRA load takes",
    )
    p.add_argument(
        "--lora-missing-path",
        action="extend",
        nargs="+",
        default=[],
        metavar="PATH",
        help="a runtime LoRA load from PATH answers vLLM's 404 (no adapter found there)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument(
        "--always-report-cached-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send prompt_tokens_details {cached_tokens: 0} on a miss, as vLLM 0.34 does "
        "(--no-always-report-cached-tokens: null on a miss, as older releases)",
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="as vLLM's flag: every stream carries usage (on each chunk and in a final usage "
        "chunk) whether or not the request set stream_options.include_usage",
    )
    p.add_argument(
        "--instant", action="store_true", help="no simulated time at all: answer immediately"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tokens")
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish vLLM KV cache events on a ZMQ PUB socket bound here, e.g. tcp://*:5557 "
        "(the port is offset by the replica's index with --count)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="ROUTER socket answering replay requests, e.g. tcp://*:5558 (offset like the PUB)",
    )
    p.add_argument("--kv-events-topic", default="", help="topic of the KV event messages")
    p.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=d["kv_events_buffer_steps"].default,
        help="event batches kept for replay",
    )
    p.add_argument(
        "--kv-connector",
        default=None,
        choices=("NixlConnector",),
        help="serve disaggregated requests as vLLM's --kv-transfer-config with this connector "
        "(pull mode, kv_both): a prefill leg (kv_transfer_params.do_remote_decode) pins its "
        "blocks for the decode leg, a decode leg (do_remote_prefill) pulls the blocks it lacks",
    )
    p.add_argument(
        "--nixl-side-channel-host",
        default=d["nixl_side_channel_host"].default,
        help="the host prefill legs name in remote_host (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST, "
        "default localhost: set it when prefill and decode replicas are on different hosts)",
    )
    p.add_argument(
        "--kv-lease-s",
        type=float,
        default=d["kv_lease_s"].default,
        help="how long a prefill leg's blocks stay pinned for its decode leg (extended by the "
        "decode replica's heartbeats while it queues the request)",
    )
    p.add_argument(
        "--kv-handshake-s",
        type=float,
        default=d["kv_handshake_s"].default,
        help="the first pull of a decode replica from a prefill replica pays this handshake",
    )
    p.add_argument(
        "--kv-block-transfer-s",
        type=float,
        default=d["kv_block_transfer_s"].default,
        help="time to pull one KV block; a decode replica's pulls share its link (one at a time)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default=d["kv_load_failure_policy"].default,
        choices=("fail", "recompute"),
        help="a decode leg whose pull fails: end it with an error (vLLM's default) or compute "
        "the prompt itself",
    )
    p.add_argument(
        "--log-level", default="warning", type=str.lower, choices=LOG_LEVELS, help="logging level"
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        root=args.root,
        tokenizer=args.tokenizer or DEFAULT_TOKENIZER,
        chat_template=args.chat_template,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        cpu_offload_blocks=args.cpu_offload_blocks,
        cpu_load_cost=args.cpu_load_cost,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        decode_cost_tokens=args.decode_cost_tokens,
        request_overhead_s=args.request_overhead_s,
        max_tokens_default=args.max_tokens_default,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        lora_adapters=list(args.lora),
        allow_runtime_lora=args.allow_runtime_lora,
        lora_load_s=args.lora_load_s,
        lora_missing_paths=list(args.lora_missing_path),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        always_report_cached_tokens=args.always_report_cached_tokens,
        enable_force_include_usage=args.enable_force_include_usage,
        instant=args.instant,
        seed=args.seed,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_connector=args.kv_connector,
        nixl_side_channel_host=args.nixl_side_channel_host,
        kv_lease_s=args.kv_lease_s,
        kv_handshake_s=args.kv_handshake_s,
        kv_block_transfer_s=args.kv_block_transfer_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
    )


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before the tokenizer's seconds of loading (UsageError)."""
    at_least("--count", args.count, 1)
    check_port("--port", args.port, allow_zero=True)
    if args.port and args.port + args.count - 1 > 65535:
        raise UsageError(
            f"--count {args.count} replicas from --port {args.port} run past port 65535; "
            "pass a lower --port or --port 0"
        )
    check_tokenizer("--tokenizer", args.tokenizer)
    if args.port:
        for i in range(args.count):
            check_can_listen(args.host, args.port + i)


def _flag_error(e: ValueError) -> str:
    """SimConfig's message in the flags' words (``SimConfig.block_size`` -> ``--block-size``)."""
    return re.sub(r"SimConfig\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(e))


def load_renderer(tokenizer: str, chat_template: str | None = None) -> Renderer:
    try:
        load_chat_template(chat_template)
    except (OSError, ValueError) as e:
        raise UsageError(one_line(e)) from None
    try:
        renderer = get_renderer(tokenizer, chat_template)
        get_vllm_chat(tokenizer, chat_template)
        get_words(renderer)
    except Exception as e:  # transformers raises OSError, ValueError, hub errors...
        cause = one_line(e).split(";")[0].rstrip(".")
        raise UsageError(
            f"cannot load tokenizer {tokenizer!r}: {cause}; pass --tokenizer "
            "with a directory holding tokenizer.json, or leave it out for the bundled one "
            "(a model id is read from the local Hugging Face cache; HF_HUB_OFFLINE=0 downloads)"
        ) from None
    return renderer


async def _serve(cfg: SimConfig, host: str, port: int, count: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    renderer = await asyncio.to_thread(load_renderer, cfg.tokenizer, cfg.chat_template)
    replicas: list[SimReplica] = []
    try:
        for i in range(count):
            r = SimReplica(offset_kv_ports(cfg, i), renderer)
            try:
                await r.start(host, port + i if port else 0)
            except OSError as e:  # taken since check_args
                raise UsageError(listen_error(host, port + i if port else 0, e)) from None
            replicas.append(r)
            print(f"ready {r.url}", flush=True)
        await stop.wait()
        return 0
    finally:
        for r in replicas:
            await r.stop()


def _offset_port(endpoint: str | None, i: int) -> str | None:
    """vLLM's ``offset_endpoint_port``: replica i of --count publishes on port + i."""
    if not endpoint or i == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if port == "*" else f"{base}:{int(port) + i}"


def offset_kv_ports(cfg: SimConfig, i: int) -> SimConfig:
    return dataclasses.replace(
        cfg,
        kv_events_endpoint=_offset_port(cfg.kv_events_endpoint, i),
        kv_events_replay_endpoint=_offset_port(cfg.kv_events_replay_endpoint, i),
    )


def main(argv: list[str] | None = None, prog: str = "prefix-router replica") -> int:
    return run(prog, lambda: _main(build_parser(prog).parse_args(argv)))


def _main(args: argparse.Namespace) -> int:
    check_args(args)
    # A model id is looked up in the local Hugging Face cache only, as the gateway does:
    # offline, a hub lookup retries for most of a minute before failing.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise UsageError(_flag_error(e)) from None
    return asyncio.run(_serve(cfg, args.host, args.port, args.count))
