"""The body of ``POST /v1/responses`` (OpenAI's fields that kvik runs)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from kvik_server.protocol import INT64_MAX, INT64_MIN, OpenAIModel


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extras.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background responses are not supported")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ValueError("input must not be empty")
        return self
