"""Incremental detokenisation of the default model's byte-level BPE: the fast path (the Rust
DecodeStream) and the slow-tokenizer path give the same text, whole characters only, and the slow
path decodes a bounded window of ids per token however long the output grows."""

from __future__ import annotations

import pytest

from kvik.engine.detokenizer import IncrementalDetokenizer
from kvik.engine.input_processor import load_tokenizer
from kvik.model_loader.default_model import default_model_path

TEXT = ("Zürich — 東京 🙂 naïve café. " * 20) + "The end."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


class DecodeOnly:
    """A tokenizer as the slow path sees one: only ``decode`` (no Rust core), counting how many
    ids each call decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_slow_path_matches_the_fast_path_in_a_bounded_window(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 200
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters split over tokens
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    fast = IncrementalDetokenizer(tokenizer, prompt)
    slow_tokenizer = DecodeOnly(tokenizer)
    slow = IncrementalDetokenizer(slow_tokenizer, prompt)
    assert fast.backend is not None and slow.backend is None
    fast_chunks = [fast.step(i) for i in ids]
    slow_chunks = [slow.step(i) for i in ids]
    assert all("\ufffd" not in c for c in fast_chunks + slow_chunks)
    assert "".join(slow_chunks) == "".join(fast_chunks)
    assert "".join(slow_chunks).strip() == TEXT.strip()
    # Two decodes a token, each of a few ids: the window moves on as text completes, so no step
    # re-decodes the output so far.
    assert len(slow_tokenizer.lengths) == 2 * len(ids)
    assert max(slow_tokenizer.lengths) <= 16


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    """A stop string in the first min_tokens tokens does not end the request (as vLLM): min_tokens
    was ignored for stop strings, while it held back stop and EOS tokens."""
    from kvik.engine.output_processor import OutputProcessor
    from kvik.sampling_params import SamplingParams
    from kvik.scheduler.output import EngineCoreOutput

    ids = tokenizer.encode(" a b a b a b", add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    for min_tokens, text in ((0, " a"), (3, " a b a"), (len(ids), " a b a b a b")):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(stop=[" b"], min_tokens=min_tokens, max_tokens=len(ids))
        state = processor.add_request("r", None, prompt, params)
        for token_id in ids:
            processor.process_outputs([EngineCoreOutput("r", [token_id])])
            if state.finished:
                break
        assert state.text == text


def test_bad_words_encode_in_one_batch_as_one_by_one(tokenizer):
    """A request's bad words, each alone and after a space, as the tokenizer encodes each text
    on its own: distinct sequences in first-seen order (5,000 words once took seconds through a
    list's membership test); a lone surrogate is refused as every encode refuses it."""
    import random

    from kvik.engine.args import EngineArgs
    from kvik.engine.input_processor import InputProcessor

    processor = InputProcessor(
        EngineArgs(model=str(default_model_path())).create_engine_config().model
    )
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefgh éü東 ") for _ in range(rng.randint(1, 9))) for _ in range(300)
    ]
    words += ["hello", " hello", "hello"]
    expected: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in expected:
                expected.append(ids)
    assert processor._encode_bad_words(tuple(words)) == tuple(expected)
    with pytest.raises(ValueError, match="lone surrogate"):
        processor._encode_bad_words(("fine", "bad\ud800"))


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2's and Mistral's: byte tokens for what the
    vocabulary lacks, "▁" for spaces, the first leading space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(["▁", "▁a", "▁ab", "▁c"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return tokenizer, vocab


def test_invalid_utf8_from_a_byte_fallback_tokenizer_does_not_raise():
    """A lone lead byte (0xD2) then a word: the tokenizer decodes the byte run "h" 0xD2 as two
    U+FFFD, so the text no longer begins with the "h" the stream handed out and DecodeStream
    raised "Invalid prefix encountered", which ended the server's output loop and every request
    in flight. The stream starts again (primed as before): the text handed out stays, the rest
    follows with the invalid byte as U+FFFD."""
    tokenizer, vocab = byte_fallback_tokenizer()
    ids = [vocab["<0x68>"], vocab["<0xD2>"], vocab["▁ab"], vocab["▁c"]]
    assert tokenizer.decode(ids) == "\ufffd\ufffd ab c"
    detokenizer = IncrementalDetokenizer(tokenizer, [vocab["▁a"]])
    assert [detokenizer.step(i) for i in ids] == ["h", "", "\ufffd ab", " c"]
