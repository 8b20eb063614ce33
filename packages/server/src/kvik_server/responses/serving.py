"""``POST /v1/responses``: a Responses request rendered as a chat, run on the engine, and its
output returned as items (reasoning, message, function calls), whole or as OpenAI's streamed
events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from kvik.outputs import CompletionOutput
from kvik_server.errors import APIError
from kvik_server.output_parsing import output_parser
from kvik_server.protocol import SamplingFields
from kvik_server.responses.events import ResponseEvents
from kvik_server.responses.items import (
    input_messages,
    item_id,
    items_as_messages,
    output_items,
    text_format,
)
from kvik_server.responses.protocol import ResponsesRequest
from kvik_server.responses.store import ResponseStore, StoredResponse
from kvik_server.serving import (
    ChatCompletions,
    _chain,
    _start_all,
    check_priority,
    error_status,
    sampling_params,
)
from kvik_server.tools.choice import (
    ToolOptions,
    ToolPlan,
    apply_tool_plan,
    parse_tools,
    plan_tools,
)
from kvik_server.tools.messages import template_messages


class Responses:
    def __init__(
        self, chat: ChatCompletions, max_stored: int, tool_options: ToolOptions | None = None
    ) -> None:
        self.chat = chat
        self.engine = chat.engine
        self.model_name = chat.model_name
        self.store = ResponseStore(max_stored)
        self.tool_options = tool_options or ToolOptions()

    async def create(
        self, request: ResponsesRequest, arrival_time: float | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        check_priority(self.engine, request.priority)
        for name, asked in (
            ("top_logprobs", bool(request.top_logprobs)),
            ("include", "message.output_text.logprobs" in (request.include or [])),
        ):
            if asked:
                # Ignored, the reply came without them (its output_text's logprobs empty).
                raise APIError(
                    "logprobs are not supported by /v1/responses (/v1/chat/completions has them)",
                    param=name,
                )
        tools = parse_tools(request.tools, nested=False)
        plan = plan_tools(
            tools,
            request.tool_choice,
            request.parallel_tool_calls,
            self.tool_options.enable_auto_tool_choice,
            self.tool_options.tool_call_parser,
            nested_choice=False,
        )
        fmt, constraint = text_format(request.text)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise APIError(
                    f"previous response {request.previous_response_id!r} is not stored (never "
                    "made with store, deleted, or evicted by newer ones)",
                    param="previous_response_id",
                )
            history = previous.messages
        conversation = history + input_messages(request.input)
        system = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        prompt = self.engine.apply_chat_template(
            template_messages(system + conversation),
            chat_template=self.chat.chat_template,
            chat_template_kwargs={"tools": plan.template_tools} if plan.template_tools else None,
        )
        fields = SamplingFields.model_validate(
            {
                name: getattr(request, name)
                for name in ("temperature", "top_p", "seed", "top_k")
                if getattr(request, name) is not None
            }
        )
        params = sampling_params(self.engine, fields, request.max_output_tokens, None, None)
        params.structured_outputs = constraint
        apply_tool_plan(params, plan)
        response = _Response(request, item_id("resp"), fmt, plan, conversation, self.model_name)
        stream = self.engine.generate(
            prompt,
            params,
            response.id,
            request.priority,
            "delta" if request.stream else "final",
            arrival_time,
            max_tokens_field=None if request.max_output_tokens is None else "max_output_tokens",
        )
        # A constraint the engine fails on is a 400 naming the field it came from.
        constraint = "tool_choice" if plan.mode in ("named", "required") else "text.format"
        (first,) = await _start_all([stream], not request.stream, constraint)
        events = _chain(first, stream, constraint)
        parser = output_parser(self.engine, plan, prompt.get("prompt"))
        if request.stream:
            return self._stream(response, events, parser)
        completion = None
        async for out in events:
            response.prompt_tokens = len(out.prompt_token_ids)
            response.cached_tokens = out.num_cached_tokens
            completion = out.outputs[0] if out.outputs else completion
        assert completion is not None
        message = parser.parse(completion.text)
        response.output_tokens = len(completion.token_ids)
        response.reasoning_tokens = self._count_tokens(message.reasoning)
        body = response.body(output_items(message), _status(completion))
        self._remember(response, body)
        return body

    async def _stream(
        self, response: _Response, events: AsyncIterator, parser: Any
    ) -> AsyncIterator[str]:
        emit = ResponseEvents()
        yield emit.event("response.created", response=response.body([], "in_progress"))
        yield emit.event("response.in_progress", response=response.body([], "in_progress"))
        last: CompletionOutput | None = None
        reasoning = ""
        try:
            async for out in events:
                response.prompt_tokens = len(out.prompt_token_ids)
                response.cached_tokens = out.num_cached_tokens
                for delta in out.outputs:
                    last = delta
                    response.output_tokens += len(delta.token_ids)
                    step = parser.feed(delta.text)
                    if delta.finish_reason is not None:
                        end = parser.finish()
                        step.reasoning += end.reasoning
                        step.content += end.content
                        step.tool_calls += end.tool_calls
                    reasoning += step.reasoning
                    for event in emit.step(step):
                        yield event
        except APIError as e:
            yield emit.event("error", code=str(e.status), message=e.message, param=e.param)
            return
        except Exception as e:
            # The engine's death is a 503, as a stream of the other routes says (it was a 500).
            yield emit.event("error", code=str(error_status(e)), message=str(e), param=None)
            return
        for event in emit.close_all():
            yield event
        response.reasoning_tokens = self._count_tokens(reasoning)
        status = _status(last) if last is not None else "completed"
        body = response.body(emit.items, status)
        self._remember(response, body)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield emit.event(kind, response=body)

    def _count_tokens(self, text: str | None) -> int:
        """The reasoning's length in tokens, as its text encodes (the engine reports tokens per
        output, not per part of it)."""
        if not text or self.engine.tokenizer is None:
            return 0
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _remember(self, response: _Response, body: dict[str, Any]) -> None:
        if response.request.store:
            messages = response.conversation + items_as_messages(body["output"])
            self.store.put(response.id, StoredResponse(body, messages))

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(f"no stored response has the id {response_id!r}", 404)
        return stored.body

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise APIError(f"no stored response has the id {response_id!r}", 404)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _status(completion: CompletionOutput) -> str:
    return "incomplete" if completion.finish_reason == "length" else "completed"


class _Response:
    """What a response's body says besides its output."""

    def __init__(
        self,
        request: ResponsesRequest,
        response_id: str,
        fmt: dict[str, Any],
        plan: ToolPlan,
        conversation: list[dict[str, Any]],
        model_name: str,
    ) -> None:
        self.model_name = model_name
        self.request = request
        self.id = response_id
        self.created_at = int(time.time())
        self.fmt = fmt
        self.plan = plan
        self.conversation = conversation
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.reasoning_tokens = 0

    def body(self, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        request, plan = self.request, self.plan
        tool_choice: Any = plan.mode
        if plan.mode == "named":
            tool_choice = {"type": "function", "name": plan.function}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model_name,
            "status": status,
            "output": json.loads(json.dumps(output)),
            "instructions": request.instructions,
            "tools": [
                {"type": "function", "name": t.name, "description": t.description}
                | {"parameters": t.parameters, "strict": bool(t.strict)}
                for t in plan.tools
            ],
            "tool_choice": tool_choice,
            "parallel_tool_calls": plan.parallel_tool_calls,
            "text": {"format": self.fmt},
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "metadata": request.metadata or {},
            "user": request.user,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
            if status != "in_progress"
            else None,
        }
