"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF) compiled with
xgrammar, turned each step into a token bitmask that the model runner applies to the logits.

``manager.StructuredOutputManager`` (one per engine core) compiles off the critical path and owns
the per-request matchers; ``bitmask.apply_token_bitmask`` is the runner's step; ``grammar`` holds
the xgrammar calls (also used by the front end to reject a bad grammar before it reaches the core);
``reasoning`` says where a model's reasoning ends, after which the grammar applies.
"""

from kvik.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
