"""Tool calling in chat completions and responses: the request's tools and tool_choice, the
parsers that find calls in a model's output, and their streaming."""
