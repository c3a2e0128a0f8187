"""The rest of a simulated replica's HTTP surface, as vLLM answers it: ``/tokenize``,
``/detokenize``, ``/v1/models``, ``/health``, ``/version``, ``/metrics`` and
``/reset_prefix_cache``."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from aiohttp import web

from loadtest.sim.config import VLLM_VERSION
from loadtest.sim.host import Host
from loadtest.sim.protocol import OFFLOAD_BYTES, json_response, offload, opt_bool, read_json
from router.core.errors import APIError, bad_request


class Endpoints:
    """Handlers bound to one replica."""

    def __init__(self, replica: Host) -> None:
        self.r = replica

    async def tokenize(self, request: web.Request) -> web.Response:
        self.r.faults.check()  # armed faults hit /tokenize too (a gateway forwards it)
        await self.r.faults.hang()
        body, size = await read_json(request)
        self.r.resolve_model(body)
        want_strs = bool(opt_bool(body, "return_token_strs"))
        if "messages" in body:
            ids = await offload(lambda: self.r.render_chat(body), size > OFFLOAD_BYTES)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string (or send messages)", "prompt")
            add_special = opt_bool(body, "add_special_tokens")
            add_special = True if add_special is None else add_special

            def encode() -> list[int]:
                by_request = getattr(self.r.renderer, "tokenize_completion_request", None)
                try:
                    if by_request is not None:
                        return list(
                            by_request({"prompt": prompt, "add_special_tokens": add_special})[0]
                        )
                    if add_special:
                        return self.r.tokenize_prompt(prompt)
                    return list(self.r.renderer.tokenizer.encode(prompt, add_special_tokens=False))
                except APIError:
                    raise
                except Exception as e:
                    raise bad_request(f"Could not tokenize the prompt: {e}", "prompt") from None

            ids = await offload(encode, size > OFFLOAD_BYTES)
        strs = self.r.renderer.tokenizer.convert_ids_to_tokens(ids) if want_strs else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.r.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        self.r.resolve_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("tokens must be a list of token ids", "tokens")
        self.r.check_ids(tokens, "tokens")
        return json_response({"prompt": self.r.renderer.decode(tokens)})

    async def models(self, request: web.Request) -> web.Response:
        c = self.r.config

        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict:
            return {
                "id": mid,
                "object": "model",
                "created": self.r.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_DNS, mid).hex}",
                        "object": "model_permission",
                        "created": self.r.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        data = [card(c.model, c.root or c.model, None, c.max_model_len)]
        data += [card(name, f"/adapters/{name}", c.model, None) for name in c.lora_adapters]
        return json_response({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA loading (with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter
        is served from now on, under its own block chains. Answered as vLLM 0.34 answers
        (vllm/entrypoints/openai/models/serving.py, load_lora_adapter): 400 InvalidUserInput
        for a missing name or path or an adapter already loaded, 404 NotFoundError when
        nothing is found at the path; every call counted (``adapter_load_calls``)."""
        self.r.stats["adapter_load_calls"] = self.r.stats.get("adapter_load_calls", 0) + 1
        body, _ = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", type_="InvalidUserInput"
            )
        if name in self.r.config.lora_adapters or name == self.r.config.model:
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                type_="InvalidUserInput",
            )
        if self.r.config.lora_load_s:
            await asyncio.sleep(self.r.config.lora_load_s)  # reading the weights
        if path in self.r.config.lora_missing_paths:
            raise APIError(
                404,
                f"Loading lora {name} failed: No adapter found for {path}",
                type_="NotFoundError",
            )
        if name in self.r.config.lora_adapters:  # a concurrent call loaded it meanwhile
            raise APIError(
                400, f"The lora adapter '{name}' has already been loaded.", type_="InvalidUserInput"
            )
        self.r.add_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        name = body.get("lora_name")
        if name not in self.r.config.lora_adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.r.config = dataclasses.replace(
            self.r.config, lora_adapters=[a for a in self.r.config.lora_adapters if a != name]
        )
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.r.health_status)

    async def version(self, request: web.Request) -> web.Response:
        self.r.faults.check()  # armed faults hit /version too (a gateway forwards it)
        await self.r.faults.hang()
        return json_response({"version": VLLM_VERSION})

    async def metrics(self, request: web.Request) -> web.Response:
        running, waiting = self.r.engine.counts()
        m = self.r.metrics
        m.running.set(running)
        m.waiting.set(waiting)
        m.kv_usage.set(self.r.engine.pool.usage())
        m.set_lora_info(*self.r.engine.lora_counts(), max_lora=len(self.r.config.lora_adapters))
        return web.Response(
            body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.r.reset_cache()
        return web.Response(status=200)
