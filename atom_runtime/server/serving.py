"""From an OpenAI request to engine requests and back: the completions and chat endpoints' logic.

Inputs are validated against the engine (`AsyncEngine.validate`) before a response starts,
so a bad request gets a 4xx status even when it asked for a stream. Outputs come from
`AsyncEngine.generate`, which yields cumulative outputs; streams send what is new since
the last chunk. A client that goes away cancels the work, which closes the engine's
iterators and so aborts the sequences and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TypeVar

import jinja2
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from atom_runtime.async_engine import AsyncEngine, EngineDeadError
from atom_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from atom_runtime.sampling_params import InvalidRequestError, SamplingParams
from atom_runtime.server.errors import APIError, as_api_error, error_body
from atom_runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    template_tools,
)
from atom_runtime.server.reasoning import ReasoningStream, split_reasoning
from atom_runtime.server.tool_calls import TOOL_CALL_PARSERS, Call, parse_required

T = TypeVar("T")

# Logprobs too small for a float in JSON (-inf) are sent as this, as vLLM does.
_MIN_LOGPROB = -9999.0
# Status for a request whose client left before the answer (nginx's "client closed request").
_CLIENT_CLOSED = 499
# apply_chat_template's own arguments, and those it renders the template with (conversations, messages), which a
# request's chat_template_kwargs may not set (a clash is a TypeError in transformers).
_RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "conversations",
        "messages",
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


@dataclass
class _Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


@dataclass
class _Delta:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # legacy logprobs: where the next token's text starts
    finished: bool = False
    echo: str = ""  # the prompt, to send before the first text (completions' `echo`)
    echo_tokens: list[int] | None = None  # with `echo` and `logprobs`: the prompt's tokens, before the first logprobs


class _ToolStream:
    """One streamed choice's text as content and tool-call deltas, by its request's tool mode
    (`ChatCompletionRequest.tool_mode`): a named function's arguments stream as they come; a required call's JSON
    array goes out whole at the end; "auto" streams content and each call as the server's parser finds it
    (`tool_calls.TOOL_CALL_PARSERS`)."""

    def __init__(self, mode: str, function: str | None, parser: str | None):
        self.mode, self.function = mode, function
        self.parser = TOOL_CALL_PARSERS[parser][1]() if mode == "auto" else None
        self.text = ""  # a required choice's, until it ends
        self.calls = 0  # calls sent

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode == "none":
            return text or None, []
        if self.mode == "named":
            if self.calls:
                return None, [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))] if text else []
            return None, self._open([Call(self.function, text)])
        if self.mode == "required":
            self.text += text
            if not finished:
                return None, []
            calls = parse_required(self.text)
            return (self.text or None, []) if calls is None else (None, self._open(calls))
        content, calls = self.parser.feed(text)
        if finished:
            rest, more = self.parser.finish()
            content, calls = content + rest, calls + more
        return content or None, self._open(calls)

    def _open(self, calls: list[Call]) -> list[DeltaToolCall]:
        deltas = [
            DeltaToolCall(
                index=self.calls + i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(calls)
        ]
        self.calls += len(calls)
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """A choice that stopped after calling (auto or required) finishes with "tool_calls", as OpenAI's."""
        return "tool_calls" if reason == "stop" and self.calls and self.mode in ("auto", "required") else reason


def _tool_calls(
    mode: str, function: str | None, parser: str | None, text: str, reason: str | None
) -> tuple[str | None, list[Call], str]:
    """(content, calls, finish_reason) of a whole choice, by its request's tool mode (see `_ToolStream`)."""
    if mode == "named":
        return None, [Call(function, text)], reason
    if mode == "required":
        content, calls = None, parse_required(text)
    elif mode == "auto":
        content, calls = TOOL_CALL_PARSERS[parser][0](text)
    else:
        calls = None
    if not calls:  # (a required call cut short by max_tokens: its text, as content)
        return text, [], reason
    return content, calls, "tool_calls" if reason == "stop" else reason


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        """`tool_call_parser`: finds the calls in a completion that chose to make them (tool_choice "auto"; vLLM's
        --enable-auto-tool-choice --tool-call-parser), None where the server does not offer that;
        `reasoning_parser`: sets a reasoning model's thinking apart from its answer (vLLM's --reasoning-parser)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    # ---- /v1/completions ---------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            params = request.sampling_params(self.engine.sampling_defaults)
            prompts = [await self._prompt(p) for p in request.prompts()]
            outputs = await self._generate(prompts, params, request_id, request.stream)
        except InvalidRequestError as error:  # name the field the client sent
            error.param = request.field_of(error.param)
            raise
        if request.scores_only:
            outputs = _without_generation(outputs)
        if request.stream:
            return _sse(self._completion_chunks(request, request_id, prompts, params, outputs))
        finals = await _unless_disconnected(raw, _final_outputs(outputs, len(prompts)))
        choices = []
        for p, final in enumerate(finals):
            for completion in final.outputs:
                sent = self._completion_sent(request, prompts[p], params)
                choice = self._completion_choice(request, p * params.n + completion.index, sent, completion, final)
                choice.prompt_token_ids = final.prompt_token_ids if request.return_token_ids else None
                choice.prompt_logprobs = _prompt_logprobs(final, request.prompt_logprobs)
                choices.append(choice)
        body = CompletionResponse(id=request_id, model=self.served_model_name, choices=choices, usage=_usage(finals))
        return _json(body)

    async def _completion_chunks(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        params: SamplingParams,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[BaseModel]:
        sent: dict[int, _Sent] = {}
        finals: list[RequestOutput | None] = [None] * len(prompts)
        created = int(time.time())  # every chunk has the same, as OpenAI's

        def chunk(*choices: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=self.served_model_name, choices=list(choices), usage=usage
            )

        announced: set[int] = set()  # choices whose prompt token ids went out (return_token_ids), with their first
        async for p, output in outputs:
            finals[p] = output
            for completion in output.outputs:
                index = p * params.n + completion.index
                if index not in sent:
                    sent[index] = self._completion_sent(request, prompts[p], params)
                choice = self._completion_choice(request, index, sent[index], completion, output)
                if choice is not None:
                    if request.return_token_ids and index not in announced:
                        choice.prompt_token_ids = output.prompt_token_ids
                        announced.add(index)
                    usage = _usage([f for f in finals if f is not None]) if request.continuous_usage else None
                    yield chunk(choice, usage=usage)
        if request.include_usage:
            yield chunk(usage=_usage(finals))

    def _completion_sent(self, request: CompletionRequest, prompt: _Prompt, params: SamplingParams) -> _Sent:
        """A choice's `_Sent` before its first news: with `echo`, the prompt to send first (and its tokens), as the
        request runs it (truncate_prompt_tokens)."""
        if not request.echo:
            return _Sent()
        ran = self.engine.truncated(prompt.token_ids, params)
        text = self._prompt_text(prompt) if len(ran) == len(prompt.token_ids) else self.engine.tokenizer.decode(ran)
        return _Sent(echo=text, echo_tokens=ran if request.logprobs is not None else None)

    def _completion_choice(
        self, request: CompletionRequest, index: int, sent: _Sent, completion: CompletionOutput, output: RequestOutput
    ) -> CompletionChoice | None:
        """The choice's news since `sent` (everything, for a fresh `_Sent`), or None if there is none."""
        delta = _advance(sent, index, completion, with_tokens=request.logprobs is not None or request.return_token_ids)
        if delta is None:
            return None
        logprobs = None
        if delta.logprobs is not None:
            logprobs = CompletionLogprobs()
            entries = list(zip(delta.token_ids, delta.logprobs, strict=True))
            if sent.echo_tokens is not None:  # the echoed prompt's tokens first, the first with no logprob
                entries[:0] = zip(sent.echo_tokens, output.prompt_logprobs, strict=True)
                sent.echo_tokens = None
            for token_id, entry in entries:
                if entry is None:
                    token, logprob, top = self.engine.tokenizer.decode([token_id]), None, None
                else:
                    token, logprob = entry[token_id].decoded_token or "", max(entry[token_id].logprob, _MIN_LOGPROB)
                    top = {}
                    for lp in sorted(entry.values(), key=lambda lp: lp.rank):  # tokens that decode alike: the likeliest
                        if lp.rank <= request.logprobs or lp is entry[token_id]:
                            top.setdefault(lp.decoded_token or "", max(lp.logprob, _MIN_LOGPROB))
                logprobs.tokens.append(token)
                logprobs.token_logprobs.append(logprob)
                logprobs.top_logprobs.append(top)
                logprobs.text_offset.append(sent.text_offset)
                sent.text_offset += len(token)
        return CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if request.return_token_ids else None,
        )

    # ---- /v1/chat/completions ----------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            mode = request.tool_mode(self.tool_call_parser is not None)
            params = request.sampling_params(self.engine.sampling_defaults)
            prompt = await self._render_chat(
                request.messages,
                request.chat_template_kwargs,
                request.add_generation_prompt,
                request.continue_final_message,
                template_tools(request.tools),
            )
            outputs = await self._generate([prompt], params, request_id, request.stream)
        except InvalidRequestError as error:  # name the field the client sent
            error.param = request.field_of(error.param)
            raise
        function = request.named_tool().name if mode == "named" else None
        if request.stream:
            ran = self.engine.truncated(prompt.token_ids, params)
            return _sse(self._chat_chunks(request, request_id, params, outputs, mode, function, ran))
        (final,) = await _unless_disconnected(raw, _final_outputs(outputs, 1))
        choices = []
        for completion in final.outputs:
            delta = _advance(_Sent(), completion.index, completion, with_tokens=True)
            reasoning, answer = None, delta.text
            if self.reasoning_parser is not None:
                constrained = params.structured_outputs is not None
                reasoning, answer = split_reasoning(self.reasoning_parser, delta.text, constrained)
            content, calls, finish_reason = None, [], delta.finish_reason
            if answer is not None:
                content, calls, finish_reason = _tool_calls(
                    mode, function, self.tool_call_parser, answer, delta.finish_reason
                )
            tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls),
                    logprobs=self._chat_logprobs(delta, params),
                    finish_reason=finish_reason,
                    stop_reason=delta.stop_reason,
                    token_ids=delta.token_ids if request.return_token_ids else None,
                )
            )
        body = ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=_usage([final]),
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
            prompt_logprobs=_prompt_logprobs(final, request.prompt_logprobs),
        )
        return _json(body)

    async def _chat_chunks(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        params: SamplingParams,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        tool_mode: str,
        function: str | None,
        prompt_token_ids: list[int],
    ) -> AsyncIterator[BaseModel]:
        """`tool_mode`, `function`: the request's use of tools (`_ToolStream`); `prompt_token_ids`: the prompt as the
        request runs it, for the chunks before the first output (its length in their usage, itself in the first with
        return_token_ids)."""
        created = int(time.time())  # every chunk has the same, as OpenAI's

        def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.served_model_name, choices=list(choices), usage=usage
            )

        # As OpenAI does: every choice opens with the role, before any text.
        # (with continuous usage stats every chunk has the usage so far, these too, as vLLM's)
        prompt_tokens = len(prompt_token_ids)
        opening = Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens) if request.continuous_usage else None
        for index in range(params.n):
            role = chunk(ChatChunkChoice(index=index, delta=Delta(role="assistant", content="")), usage=opening)
            if request.return_token_ids and index == 0:
                role.prompt_token_ids = prompt_token_ids
            yield role
        sent = [_Sent() for _ in range(params.n)]
        streams = [_ToolStream(tool_mode, function, self.tool_call_parser) for _ in range(params.n)]
        constrained = params.structured_outputs is not None
        parser = self.reasoning_parser
        thinking = [ReasoningStream(parser, constrained) if parser else None for _ in range(params.n)]
        with_tokens = params.logprobs is not None or request.return_token_ids
        final = None
        async for _, final in outputs:
            for completion in final.outputs:
                delta = _advance(sent[completion.index], completion.index, completion, with_tokens)
                if delta is not None:
                    stream, finished = streams[delta.index], delta.finish_reason is not None
                    reasoning, answer = "", delta.text
                    if (reasoner := thinking[delta.index]) is not None:
                        reasoning, answer = reasoner.feed(delta.text)
                        if finished:
                            held = reasoner.finish()
                            reasoning, answer = reasoning + held[0], answer + held[1]
                    content, tool_calls = stream.feed(answer, finished)
                    if not (content or reasoning or tool_calls or finished or with_tokens):
                        continue  # all of it held back (a call's JSON, a tag): no empty delta, as vLLM's
                    yield chunk(
                        ChatChunkChoice(
                            index=delta.index,
                            delta=Delta(
                                content=content, reasoning_content=reasoning or None, tool_calls=tool_calls or None
                            ),
                            logprobs=self._chat_logprobs(delta, params),
                            finish_reason=stream.finish_reason(delta.finish_reason),
                            stop_reason=delta.stop_reason,
                            token_ids=delta.token_ids if request.return_token_ids else None,
                        ),
                        usage=_usage([final]) if request.continuous_usage else None,
                    )
        if request.include_usage:
            yield chunk(usage=_usage([final]))

    async def _render_chat(
        self,
        messages: list[ChatMessage],
        template_kwargs: dict | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> _Prompt:
        """The conversation through the model's chat template, ending where the assistant's turn begins (or, with
        `continue_final_message`, inside the last message); `template_kwargs` are the template's own variables
        (Qwen3's enable_thinking, ...); `tools` the functions offered, as the template writes them."""
        tokenizer = self.engine.tokenizer
        if tokenizer.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions, or serve with --chat-template", "messages"
            )
        if reserved := sorted(set(template_kwargs or {}) & _RENDER_ARGUMENTS):
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        try:
            text = tokenizer.apply_chat_template(
                [m.template_input() for m in messages],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except jinja2.TemplateError as error:
            raise InvalidRequestError(f"the chat template rejected the messages: {error}", "messages") from error
        # The template writes the special tokens (BOS included) itself.
        return _Prompt(text, await self.engine.tokenize(text, add_special_tokens=False))

    @staticmethod
    def _chat_logprobs(delta: _Delta, params: SamplingParams) -> ChatLogprobs | None:
        if delta.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=True):
            top = sorted((lp for lp in entry.values() if lp.rank <= params.logprobs), key=lambda lp: lp.rank)
            chosen = _top_logprob(entry[token_id])
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[_top_logprob(lp) for lp in top]))
        return ChatLogprobs(content=content)

    # ---- /tokenize, /detokenize (vLLM's) ------------------------------------------------

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("give a prompt or messages, not both or neither", "prompt")
        if request.messages is not None:
            rendered = await self._render_chat(
                request.messages,
                request.chat_template_kwargs,
                request.add_generation_prompt,
                request.continue_final_message,
                template_tools(request.tools),
            )
            tokens = rendered.token_ids
        else:
            tokens = await self.engine.tokenize(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        max_model_len = self.engine.max_model_len
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.engine.limits.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(request.tokens))

    # ---- shared ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the model '{model}' does not exist; this server serves '{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    async def _prompt(self, prompt: str | list[int]) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, await self.engine.tokenize(prompt))
        return _Prompt(None, list(prompt))

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)

    async def _generate(
        self, prompts: list[_Prompt], params: SamplingParams, request_id: str, stream: bool
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Checks every prompt now (so errors come before a response starts), then runs them all."""
        if not self.engine.is_healthy:
            raise EngineDeadError("the engine has stopped; see the server log")
        for prompt in prompts:
            await self.engine.validate(prompt.token_ids, params)
        return _merge(
            [
                self.engine.generate(
                    p.text, params, prompt_token_ids=p.token_ids, request_id=f"{request_id}-{i}", stream=stream
                )
                for i, p in enumerate(prompts)
            ]
        )


def _advance(sent: _Sent, index: int, completion: CompletionOutput, with_tokens: bool) -> _Delta | None:
    """Moves `sent` to the end of `completion`; returns what was new, or None if nothing a client would see."""
    if sent.finished:
        return None
    text = completion.text[sent.chars :]
    token_ids = completion.token_ids[sent.tokens :]
    finish_reason = completion.finish_reason
    if not text and finish_reason is None and not (with_tokens and token_ids):
        return None  # only held-back text (a possible stop string, or bytes of an unfinished character)
    logprobs = completion.logprobs[sent.tokens :] if completion.logprobs is not None else None
    sent.chars, sent.tokens, sent.finished = len(completion.text), len(completion.token_ids), finish_reason is not None
    text, sent.echo = sent.echo + text, ""
    return _Delta(index, text, token_ids, logprobs, finish_reason, completion.stop_reason)


def _prompt_logprobs(output: RequestOutput, k: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field: each prompt token's entry, the prompt's token and the top `k` (the request's
    own k: echo may have asked the engine for more)."""
    if k is None or output.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            token: PromptLogprob(logprob=max(lp.logprob, _MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token)
            for i, (token, lp) in enumerate(entry.items())
            if i == 0 or lp.rank <= k
        }
        for entry in output.prompt_logprobs
    ]


def _top_logprob(logprob: Logprob) -> TopLogprob:
    token = logprob.decoded_token or ""
    return TopLogprob(token=token, logprob=max(logprob.logprob, _MIN_LOGPROB), bytes=list(token.encode()))


def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    generated = sum(len(c.token_ids) for f in finals for c in f.outputs)
    cached = sum(f.metrics.num_cached_tokens for f in finals if f.metrics is not None)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=generated,
        total_tokens=prompt + generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _sse(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
        except Exception as error:  # noqa: BLE001  (the status line is gone: the error travels as an event)
            yield f"data: {error_body(as_api_error(error))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves the prompts' output streams as outputs arrive, tagged with their prompt index.

    Leaving early (error, disconnect) cancels the readers, which closes the engine's iterators
    and so aborts the unfinished requests.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as error:  # noqa: BLE001  (re-raised by the consumer)
            queue.put_nowait((i, error))
        else:
            queue.put_nowait((i, None))

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(readers)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def _without_generation(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Each prompt's final output with its samples emptied (`CompletionRequest.scores_only`): no text, tokens or
    logprobs of their own, ended by the length limit of 0."""
    async for p, output in outputs:
        if output.finished:
            emptied = [
                replace(
                    c,
                    text="",
                    token_ids=[],
                    cumulative_logprob=None,
                    logprobs=None if c.logprobs is None else [],
                    finish_reason="length",
                    stop_reason=None,
                )
                for c in output.outputs
            ]
            yield p, replace(output, outputs=emptied)


async def _final_outputs(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * count
    async for i, output in outputs:
        finals[i] = output
    return finals


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (a non-streamed request has no
    other way to notice: nothing is written to the socket until the end)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise APIError(_CLIENT_CLOSED, "the client disconnected before the response was ready")
    return task.result()
