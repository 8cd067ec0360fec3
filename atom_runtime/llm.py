"""The offline API, in vLLM's shape: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
import uvloop
from tqdm.auto import tqdm

from atom_runtime.config import EngineConfig
from atom_runtime.loading import create_engine, read_chat_template
from atom_runtime.outputs import RequestOutput
from atom_runtime.sampling_params import SamplingParams


class LLM:
    """Loads a model (an artifact from atom-compile, or an HF directory run eagerly) and generates for batches of
    prompts.

    Engine settings (max_num_seqs, block_size, enable_prefix_caching, ...) are keyword
    arguments, as in vLLM; see `EngineConfig`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        quantization: str | None = None,
        quantization_exclude: str | Sequence[str] = (),
        load_dummy: bool = False,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,  # vLLM's; atom runs its own model code, never a checkpoint's
        generation_config: str = "auto",
        **engine_args,
    ):
        """`generation_config`: where sampling defaults come from (`get_default_sampling_params`): "auto" (the
        model's generation_config.json), "vllm" (SamplingParams' own) or a directory holding such a file."""
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size}: atom runs a model on one device")
        if isinstance(quantization_exclude, str):
            quantization_exclude = [quantization_exclude]
        self.engine = create_engine(
            model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            quantization_exclude=quantization_exclude,
            load_dummy=load_dummy,
            generation_config=generation_config,
            config=EngineConfig(**engine_args),
        )
        self.tokenizer = self.engine.tokenizer
        self._loop = uvloop.new_event_loop()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's recommended sampling (its generation config), what `generate` and `chat` use without any."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given. A prompt is a string, or as vLLM takes them a
        {"prompt": text} or {"prompt_token_ids": [...]} dict."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give either prompts or prompt_token_ids")
        if prompts is not None:
            requests = [_request(p) for p in ([prompts] if isinstance(prompts, str | dict) else prompts)]
        else:
            ids = list(prompt_token_ids)
            requests = [(None, list(x)) for x in ([ids] if ids and isinstance(ids[0], int) else ids)]
        return self._run(requests, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or several, each through the
        model's chat template, or `chat_template` (the template or its file), with `chat_template_kwargs` (e.g. Qwen3's
        enable_thinking); one finished RequestOutput per conversation, in order."""
        if chat_template is not None:
            chat_template = read_chat_template(chat_template)
        elif self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; pass chat_template, or use generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        requests = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in conversation],
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # the template writes the special tokens itself
            requests.append((text, self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return self._run(requests, sampling_params, use_tqdm)

    def _run(self, requests: list[tuple], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if self._loop.is_closed():
            raise RuntimeError("this LLM has been shut down")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(requests)
        else:
            params = list(sampling_params)
            if len(params) != len(requests):
                raise ValueError(f"{len(params)} sampling_params for {len(requests)} prompts")
        main = self._loop.create_task(self._generate_all(requests, params, use_tqdm))
        try:
            return self._loop.run_until_complete(main)
        except BaseException:
            # Interrupted (Ctrl-C in a notebook): the requests stop, as when one fails (`_generate_all`), rather than
            # generate on in the engine ahead of the next call's.
            main.cancel()
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(main)
            raise

    async def _generate_all(self, requests, params, use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm)

        async def one(request, p: SamplingParams) -> RequestOutput:
            prompt, ids = request
            final = None
            async for output in self.engine.generate(prompt, p, prompt_token_ids=ids, stream=False):
                final = output
            bar.update(1)
            return final

        tasks = [asyncio.ensure_future(one(r, p)) for r, p in zip(requests, params, strict=True)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            # A request that failed (a prompt the engine refuses) fails the call: the others stop with it, rather than
            # generating on in the engine ahead of the next call's, their tasks left pending in this loop.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()

    def shutdown(self) -> None:
        self.engine.shutdown()
        if not self._loop.is_closed():
            self._loop.close()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(free_memory=False)  # no device calls from a collector, perhaps at interpreter exit


def _request(prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt as `generate` takes it."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict) and set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"], None
    if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
        return None, list(prompt["prompt_token_ids"])
    raise TypeError(
        f"a prompt is a string, {{'prompt': text}} or {{'prompt_token_ids': [...]}}, not {prompt!r:.80}; "
        "token ids as a list go to prompt_token_ids="
    )


def _template_message(message: dict) -> dict:
    """A chat message as templates take it: OpenAI's text parts joined with newlines, as vLLM and the server do."""
    if "role" not in message:
        raise ValueError(f"a chat message needs a role: {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):
        if any(part.get("type") != "text" for part in content):
            raise ValueError("only text content parts are supported")
        content = "\n".join(part["text"] for part in content)
    return {**message, "content": content if content is not None else ""}
