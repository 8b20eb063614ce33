"""OpenAI's Responses API (``/v1/responses``) over the chat machinery."""
