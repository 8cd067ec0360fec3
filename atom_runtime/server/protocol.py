"""The OpenAI API on the wire: request and response bodies of /v1/completions and /v1/chat/completions.

Requests are validated strictly (a string where a number belongs is an error, not a guess)
and accept vLLM's extra sampling fields. Value ranges are checked by `SamplingParams` and
the engine, which know the limits; these models only check shapes and types. A field the server
does not know is ignored (and logged), as vLLM does; one it knows but does not implement, and
that would change the output (beam search, logits processors, ...), is refused by name.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from atom_runtime.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams, with_defaults
from atom_runtime.server.tool_calls import required_schema

# Omit an optional field from the JSON when it is unset (extensions, usage of most stream chunks).
_OMIT_NONE = dict(default=None, exclude_if=lambda value: value is None)


class _Request(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do; known ones must have the right type.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        """The request's fields this server does not know, where it keeps them to log them (vLLM logs them too)."""
        return sorted(self.model_extra or {})


def _unset(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _refuse(field: str, what: str) -> None:
    raise InvalidRequestError(f"{field}: {what} is not supported by this server", field)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with include_usage)


class _SamplingFields(_Request):
    """Fields shared by both endpoints, OpenAI's and vLLM's extras.

    The top-level request keeps its unknown fields (`model_extra`) so the server can log them.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # add the prompt's and each choice's token ids to the response
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top k (not with stream=true)
    logit_bias: dict[str, float] | None = None  # OpenAI's: {token id: bias}, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as the context holds)
    # OpenAI's, with no effect on a self-hosted server's output: accepted as they are.
    user: str | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Known, not implemented, and they would change the output: refused unless unset (UNSUPPORTED).
    use_beam_search: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "use_beam_search": "beam search",
        "guided_whitespace_pattern": "a whitespace pattern for structured outputs",
        "logits_processors": "logits processors",
    }

    def _refuse_unsupported(self) -> None:
        for field, what in self.UNSUPPORTED.items():
            if not _unset(getattr(self, field)):
                _refuse(field, what)

    # Where the engine names a field the request calls otherwise (its errors' `param`).
    PARAMS: ClassVar[dict[str, str]] = {}

    def field_of(self, param: str | None) -> str | None:
        """The request's name for the engine's `param` (an error's): a structured output's, the field that set it."""
        if param == "structured_outputs":
            return next(iter(self._constraints()), param)
        return self.PARAMS.get(param, param)

    def _constraints(self) -> dict[str, dict]:
        """The structured output constraints the request sets, by field: StructuredOutputsParams' arguments."""
        given: dict[str, dict] = {}
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or spec.get("schema") is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema", "response_format")
            given["response_format"] = {"json": spec["schema"]}
        elif kind != "text":
            message = f"response_format type {kind!r} is not text, json_object or json_schema"
            raise InvalidRequestError(message, "response_format")
        for name in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{name}")) is not None:
                given[f"guided_{name}"] = {name: value}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        return given

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the request sets, in whichever of its fields; InvalidRequestErrors name that field."""
        given = self._constraints()
        if len(given) > 1:
            raise InvalidRequestError(f"set one structured output constraint, not {', '.join(given)}", list(given)[1])
        for field, constraint in given.items():
            try:
                return StructuredOutputsParams(**constraint)
            except InvalidRequestError as error:
                raise InvalidRequestError(str(error), field) from None
            except TypeError as error:  # a key StructuredOutputsParams does not have
                raise InvalidRequestError(f"{field}: {error}", field) from None
        return None

    def _sampling_params(
        self, defaults: dict, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """`defaults`: the model's, for fields the request leaves out (`with_defaults`); `prompt_logprobs`: what the
        endpoint needs of them besides the request's own field."""
        self._refuse_unsupported()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", "stream_options")
        if (own := self.prompt_logprobs) is not None:
            if self.stream and own > 0:  # as vLLM: 0 streams, and returns nothing
                raise InvalidRequestError("prompt_logprobs are not available with stream=true", "prompt_logprobs")
            if own < 0 or not self.stream:  # a negative one goes through for SamplingParams to refuse
                prompt_logprobs = own if own < 0 else max(prompt_logprobs or 0, own)
        return with_defaults(
            defaults,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            structured_outputs=self._structured_outputs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): min(100.0, max(-100.0, bias)) for token, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # refused unless n

    UNSUPPORTED: ClassVar[dict[str, str]] = {**_SamplingFields.UNSUPPORTED, "suffix": "a suffix (insertion)"}

    def sampling_params(self, defaults: dict) -> SamplingParams:
        """`defaults`: the model's sampling defaults (`AsyncEngine.sampling_defaults`)."""
        if self.best_of is not None and self.best_of != self.n:
            _refuse("best_of", f"best_of other than n ({self.best_of} against n={self.n})")
        # echo with logprobs: the echoed prompt's tokens come with theirs (the first with none), as OpenAI's did
        echoed = self.logprobs if self.echo else None
        return self._sampling_params(defaults, 1 if self.scores_only else self.max_tokens, self.logprobs, echoed)

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt comes back with its logprobs and nothing is generated (how
        lm-evaluation-harness scores continuations; the engine runs one token, which the answer leaves out, as
        vLLM's)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a request, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return list(prompt)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # an assistant turn of a client's history may carry none
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    def template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined with newlines, a call's arguments as an
        object (templates write them out themselves), as vLLM does."""
        if self.content is None and self.role != "assistant":
            raise InvalidRequestError(f"a {self.role} message needs content", "messages")
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        return message


def _arguments(call: _ToolCallIn) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequestError(f"tool call {call.id!r}: its arguments are not JSON", "messages") from None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Passed to the chat template (Qwen3's enable_thinking, ...), as vLLM does.
    chat_template_kwargs: dict[str, Any] | None = None
    # Function calling (`tool_calls`); the legacy `functions` / `function_call` are refused.
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open for the model to continue
    echo: bool = False
    reasoning_effort: Any = None

    PARAMS: ClassVar[dict[str, str]] = {"prompt": "messages", "logprobs": "top_logprobs"}
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **_SamplingFields.UNSUPPORTED,
        "functions": "functions (the legacy function calling; use tools)",
        "chat_template": "a request's own chat template",
        "echo": "echo in chat",
        "reasoning_effort": "reasoning effort",
    }

    def field_of(self, param: str | None) -> str | None:
        """As `_SamplingFields.field_of`; max_tokens is max_completion_tokens where the request set that one."""
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_of(param)

    def tool_mode(self, auto_tools: bool) -> str:
        """How the completion uses the tools: "none", "auto" (the model may call them; `auto_tools`: the server
        parses calls), "required" (at least one call), or "named" (that function's)."""
        choice = self.tool_choice
        if not self.tools:  # (an empty list with "auto", as some clients send: nothing to call)
            if choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools", "tool_choice")
            return "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool.function.name for tool in self.tools}:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, not one of tools", "tool_choice"
                )
            return "named"
        choice = choice or "auto"
        if choice == "auto" and not auto_tools:
            message = '"auto" tool choice needs the server started with --enable-auto-tool-choice --tool-call-parser'
            raise InvalidRequestError(message, "tool_choice")
        return choice

    def named_tool(self) -> FunctionDefinition:
        return next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)

    def _constraints(self) -> dict[str, dict]:
        """A required or named tool choice is a structured output too: a call in JSON."""
        given = super()._constraints()
        if self.tools and self.tool_choice == "required":
            tools = [tool.function.model_dump(exclude_none=True) for tool in self.tools]
            given["tool_choice"] = {"json": required_schema(tools, self.parallel_tool_calls is not False)}
        elif self.tools and isinstance(self.tool_choice, NamedToolChoice):
            given["tool_choice"] = {"json": self.named_tool().parameters or {"type": "object"}}
        return given

    def sampling_params(self, defaults: dict) -> SamplingParams:
        """`defaults`: the model's sampling defaults (`AsyncEngine.sampling_defaults`)."""
        if self.function_call not in (None, "none", "auto"):  # (with no `functions`, those two change nothing)
            _refuse("function_call", "function_call (the legacy function calling; use tool_choice)")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError(
                f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}", "max_completion_tokens"
            )
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="allow")  # unknown fields are logged, as for completions

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # for messages: end where the assistant's turn begins
    continue_final_message: bool = False  # for messages: leave the last one open, for the model to continue
    add_special_tokens: bool = True  # for a prompt (a chat template writes its own)
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None  # for messages: given to the chat template


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's logprob, its rank, its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt token (None for the first): {token id: its entry}, the prompt's token first, then the top k.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(**_OMIT_NONE)
    prompt_token_ids: list[int] | None = Field(**_OMIT_NONE)
    prompt_logprobs: PromptLogprobs | None = Field(**_OMIT_NONE)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(**_OMIT_NONE)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(**_OMIT_NONE)  # a reasoning model's thinking (--reasoning-parser)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(**_OMIT_NONE)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(**_OMIT_NONE)
    prompt_logprobs: PromptLogprobs | None = Field(**_OMIT_NONE)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(**_OMIT_NONE)
    arguments: str | None = Field(**_OMIT_NONE)


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has the id, type and name, the rest add to its arguments."""

    index: int
    id: str | None = Field(**_OMIT_NONE)
    type: Literal["function"] | None = Field(**_OMIT_NONE)
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(**_OMIT_NONE)
    content: str | None = Field(**_OMIT_NONE)
    reasoning_content: str | None = Field(**_OMIT_NONE)
    tool_calls: list[DeltaToolCall] | None = Field(**_OMIT_NONE)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(**_OMIT_NONE)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(**_OMIT_NONE)
    prompt_token_ids: list[int] | None = Field(**_OMIT_NONE)  # return_token_ids: on the first chunk, as vLLM's


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atom"
    root: str | None = None  # where the model was loaded from; clients may load its tokenizer
    max_model_len: int | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(**_OMIT_NONE)


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
