"""Turning user prompts into validated Requests, and output token ids back into text."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvik.config import ModelConfig
from kvik.model_loader.resolve import TOKENIZER_FILES
from kvik.request import Request
from kvik.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: A prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.
PromptType = str | Sequence[int] | dict[str, Any]

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def load_tokenizer(name_or_path: str | Path) -> Any | None:
    """The Hugging Face tokenizer of a model folder or .gguf file, or None when there is none."""
    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        from kvik.model_loader.gguf_loader import gguf_has_tokenizer, gguf_tokenizer

        return gguf_tokenizer(path) if gguf_has_tokenizer(path) else None
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a damaged file fails deep in transformers, in several kinds
        files = ", ".join(f for f in TOKENIZER_FILES if (path / f).is_file())
        raise ValueError(
            f"the tokenizer in {path} does not load ({files}): {type(e).__name__}: {e}"
        ) from e


def encode_text(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)`` for text that is valid Unicode. JSON can carry lone
    UTF-16 surrogates ("\\ud800"), which Python keeps in a str and the tokenizers library
    refuses with a TypeError: that is the request's fault, so it is refused as a ValueError."""
    check_unicode(text)
    return list(tokenizer.encode(text, **kwargs))


def check_unicode(text: str) -> None:
    """Refuse text holding a lone surrogate (``encode_text``'s check)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"text must be valid Unicode: it holds a lone surrogate {text[e.start]!r} at "
            f"character {e.start}"
        ) from None


class InputProcessor:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.tokenizer = load_tokenizer(model_config.tokenizer or model_config.path)
        self.eos_token_ids = model_config.eos_token_ids()
        # A request's bad words are encoded when it is validated and again for each of its
        # n requests: once per distinct list.
        self._bad_word_sequences = functools.lru_cache(maxsize=256)(self._encode_bad_words)

    def _check_logprobs(self, params: SamplingParams, vocab: int) -> None:
        """vLLM's max_logprobs: a request's logprobs (-1: the whole vocabulary) within the
        engine's limit, which keeps a response of a long prompt with every prompt logprob from
        taking the server's memory."""
        limit = self.model_config.max_logprobs
        if limit == -1:
            return
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is None:
                continue
            count = vocab if asked == -1 else asked
            if count > limit:
                raise ValueError(
                    f"{name}={asked} asks for {count} logprobs a position, more than "
                    f"max_logprobs={limit} (an engine option; -1 lifts the limit)"
                )

    @staticmethod
    def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        _refuse_bytes(prompts)
        if not isinstance(prompts, Sequence):
            raise ValueError(
                "prompts must be a prompt (text, token ids or a dict) or a list of them, got "
                f"{type(prompts).__name__}"
            )
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]  # one prompt of token ids
        if not prompts:
            raise ValueError("prompts must not be empty")
        return prompts

    def process(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        # A checked copy: fields set after construction (sp.top_p = 5, sp.stop = "###") are
        # normalised and checked as at construction, and the caller's object is left as it is.
        params = replace(params)
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"SamplingParams.{name} needs a tokenizer, and the model has none")
            for text in getattr(params, name) or ():
                try:
                    # A lone surrogate: a stop string no output can hold (it was silently
                    # never found), a bad word the tokenizer cannot encode.
                    check_unicode(text)
                except ValueError as e:
                    raise ValueError(f"SamplingParams.{name}: {e}") from None
        text, token_ids = self._tokens(prompt)
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        bad = [
            t
            for t in token_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {max_len}: it must be "
                "shorter, to leave room for at least one generated token"
            )
        params.validate_token_ids(vocab)
        self._check_logprobs(params, vocab)
        if params.top_k >= vocab:
            # Every token is in the top k: the same as no top-k, and a k past the vocabulary
            # would not fit the sampler's int32 row of top-k values.
            params = replace(params, top_k=0)
        if params.bad_words:
            bad_words_token_ids = self.bad_words_token_ids(params)  # refuses text it cannot encode
        else:
            bad_words_token_ids = []
        if params.allowed_token_ids is not None:
            self._check_allowed_tokens(params, bad_words_token_ids)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        return text, token_ids, params

    def _check_allowed_tokens(
        self, params: SamplingParams, bad_words_token_ids: list[list[int]]
    ) -> None:
        """An allow-list whose every token the other parameters forbid at the first step would
        leave nothing to sample (the sampler would return a token outside the list)."""
        banned = {ids[0] for ids in bad_words_token_ids if len(ids) == 1}
        if params.min_tokens > 0:
            banned.update(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError(
                f"allowed_token_ids {sorted(set(params.allowed_token_ids))} are all forbidden at "
                "the first step (by bad_words, or as EOS or stop_token_ids while min_tokens="
                f"{params.min_tokens} has not been reached): nothing would be left to sample"
            )

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """A bad schema, regex or grammar is the caller's error (a 400 when served), caught here
        so that it never reaches the engine core."""
        from kvik.structured_output.grammar import check_grammar

        if self.tokenizer is None:
            raise ValueError(
                "SamplingParams.structured_outputs needs a tokenizer, and the model has none"
            )
        check_grammar(params.structured_outputs)

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown:
                # vLLM's multi_modal_data, prompt_embeds, cache_salt...: kvik has none of them,
                # and a prompt must not run as if they were not there.
                raise ValueError(
                    f"a dict prompt holds 'prompt' and/or 'prompt_token_ids'; {unknown} are not "
                    "supported"
                )
            if not prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
            text = prompt.get("prompt")
            if not isinstance(text, str) and (text is not None or "prompt_token_ids" not in prompt):
                # {"prompt": [5, 6]} ran as token ids, and {"prompt": 5, ...} kept 5 as its text.
                raise ValueError(
                    f"a dict prompt's 'prompt' must be a string, got {type(text).__name__}"
                )
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, list | tuple):
                    raise ValueError(
                        "a dict prompt's 'prompt_token_ids' must be a list of ints, got "
                        f"{type(token_ids).__name__}"
                    )
                return text, list(token_ids)
            prompt = text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need a tokenizer, and {self.model_config.path} has none: pass "
                    "token ids, or tokenizer=<folder>"
                )
            return prompt, encode_text(self.tokenizer, prompt)
        _refuse_bytes(prompt)
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}"
        )

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Render a conversation with the model's (or the given) chat template into a prompt."""
        validate_conversation(conversation)
        for name, value in (
            ("add_generation_prompt", add_generation_prompt),
            ("continue_final_message", continue_final_message),
        ):
            if type(value) is not bool:
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(
                f"chat_template must be a string (a Jinja template), got {type(chat_template).__name__}"
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(
                f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or ()))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: kvik sets them (a "
                "request has add_generation_prompt, continue_final_message and chat_template "
                "fields of its own)"
            )
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer, and {self.model_config.path} has none")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the model has no chat template: pass chat_template=")
        try:
            text = self.tokenizer.apply_chat_template(
                flatten_text_parts(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as e:
            # A template that does not parse, or one that refuses the conversation
            # (raise_exception) or fails on it ({{ 1 / 0 }}, {{ messages + 1 }}): the request's
            # template or messages are at fault.
            if not _is_jinja_error(e) and not _raised_in_template(e):
                raise
            what = "the chat template" if chat_template is None else "the given chat_template"
            raise ValueError(f"{what} failed: {type(e).__name__}: {e}") from None
        # The template writes any BOS itself, so no special tokens are added here.
        return {
            "prompt": text,
            "prompt_token_ids": encode_text(self.tokenizer, text, add_special_tokens=False),
        }

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (how it appears mid-text)."""
        return [list(ids) for ids in self._bad_word_sequences(tuple(params.bad_words or ()))]

    def _encode_bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
        # Distinct sequences in first-seen order (a dict: a list's membership test made 5,000
        # words take seconds), the texts encoded in one batch call where the tokenizer has one.
        sequences = dict.fromkeys(tuple(ids) for ids in self._encode_texts(texts))
        sequences.pop((), None)
        return tuple(sequences)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        for text in texts:
            check_unicode(text)
        if callable(self.tokenizer) and texts:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [encode_text(self.tokenizer, text, add_special_tokens=False) for text in texts]

    def check_max_tokens_fit(
        self, token_ids: list[int], params: SamplingParams, field: str = "max_tokens"
    ) -> None:
        """Refuse a ``max_tokens`` (from the request field ``field``) that the prompt of
        ``token_ids`` leaves no room for: the server's rule for a limit the client set. Offline,
        ``make_request`` cuts it to the room left instead (vLLM's two behaviours)."""
        max_len, prompt_len = self.model_config.max_model_len, len(token_ids)
        if params.max_tokens is not None and params.max_tokens > max_len - prompt_len:
            raise ValueError(
                f"{field} is too large: {params.max_tokens}. This model's maximum context length "
                f"is {max_len} tokens and the request has {prompt_len} input tokens "
                f"({params.max_tokens} > {max_len} - {prompt_len}); lower {field} or shorten the "
                "prompt"
            )

    def make_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
    ) -> Request:
        check_priority(priority)
        room = self.model_config.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            priority=priority,
            bad_words_token_ids=self.bad_words_token_ids(params) if params.bad_words else [],
        )


def _refuse_bytes(prompt: Any) -> None:
    # bytes are a Sequence of ints: b"hi" would silently be the token ids [104, 105].
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise ValueError(
            f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__} (decode "
            "it to a string first)"
        )


def chat_template_syntax_error(template: str) -> str | None:
    """Why a chat template does not parse, or None. Parsed in transformers' own environment, whose
    extensions ({% generation %}, loop controls) templates may use; through a private helper, so
    where it is gone nothing is checked here (requests then report the error)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        _compile_jinja_template(template)
    except Exception as e:
        if not _is_jinja_error(e):
            raise
        line = getattr(e, "lineno", None)
        return f"{e} (line {line})" if line else str(e)
    return None


def _is_jinja_error(error: Exception) -> bool:
    """jinja2's TemplateError or one of its kinds, matched by module: jinja2 is transformers'
    import, not one kvik declares."""
    return type(error).__module__.startswith("jinja2")


def _raised_in_template(error: Exception) -> bool:
    """Whether the error came from a template's own code (a ZeroDivisionError, a TypeError):
    jinja2 names the frames of template code ``<template>``."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def check_priority(priority: Any) -> None:
    """A request's priority: an int that the engine core's messages carry (64-bit signed)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if not -(2**63) <= priority < 2**63:
        raise ValueError(f"priority must be in [-2**63, 2**63), got {priority}")


def validate_conversation(conversation: Any) -> None:
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("a conversation must be a non-empty list of messages")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {role!r}; roles are {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"message {i}: only text content parts are supported")
            for j, part in enumerate(content):
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"message {i} content part {j} needs a string 'text'")
        elif not isinstance(content, str) and not (content is None and role == "assistant"):
            raise ValueError(f"message {i} content must be a string or a list of text parts")
        if "name" in message and not isinstance(message["name"], str):
            raise ValueError(f"message {i} name must be a string")


def flatten_text_parts(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message whose content is a list of text parts with its texts joined by newlines, as
    vLLM hands them to string-content templates: templates of text models (SmolLM2's, Llama's,
    Qwen's) concatenate ``message['content']`` as a string and fail on a list. An assistant's
    None content (a message of tool calls) is "", as vLLM renders it: such templates failed on
    None with a TypeError."""
    return [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else {**m, "content": ""}
        if m.get("content") is None
        else m
        for m in conversation
    ]


#: Arguments of ``apply_chat_template`` that kvik sets itself (or that would change what it
#: returns): a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def child_requests(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests of one user request: ``n`` of them, each with n=1 and its own seed."""
    if params.n == 1:
        return [(parent_id, params)]
    return [
        (
            f"{index}_{parent_id}",
            # Child i's seed is the parent's plus i, wrapped within the 64-bit signed range.
            replace(
                params,
                n=1,
                seed=None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63,
            ),
        )
        for index in range(params.n)
    ]
