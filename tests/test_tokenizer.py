import json
import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec.detokenizer import IncrementalDetokenizer
from specdec.stop import StopStringMatcher
from specdec.tokenizer import Tokenizer

MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens. "
    "中文：推测解码可以加速大语言模型的推理。日本語：投機的デコードは速いです。"
    "العربية: فك التشفير التخميني سريع. Русский: спекулятивное декодирование быстро. "
    "Emoji: 👩‍👩‍👧 family, 🇫🇷 flag, 👍🏽 thumbs, café naïve ё e\u0301 a\u0308 n\u0303. 🚀🔥✨ "
    "  two spaces,\ttab and\nnew line: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok."
)

# Trained on the text itself but small, so that many characters end up as byte
# fallbacks or as byte-level tokens straddling character boundaries.
CORPUS = [MULTILINGUAL] * 3 + ["hello world, the fox and the dog. 中文 日本語 Русский"] * 5


def _byte_level_tokenizer(extra_tokens=()) -> Tokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    raw.add_tokens(list(extra_tokens))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>"))


def _metaspace_tokenizer() -> Tokenizer:
    """Llama/SentencePiece style: "▁" for spaces, byte fallback, leading space stripped."""
    trained = RawTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    # Latin and Cyrillic only: everything else (CJK, Arabic, emoji, ZWJ) has to go through
    # byte fallback. Capping the alphabet with limit_alphabet instead is not deterministic.
    trained.train_from_iterator(["".join(c for c in t if ord(c) < 0x500) for t in CORPUS], trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = state["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    raw = RawTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    raw.pre_tokenizer = trained.pre_tokenizer
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return _byte_level_tokenizer()


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    return _metaspace_tokenizer()


@pytest.fixture
def smollm2(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        yield ids[i : i + n]
        i += n


def _assert_streams_like_one_shot(tok: Tokenizer, text: str = MULTILINGUAL) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids)
    schedules = {"one at a time": [[i] for i in ids]}
    for seed in range(5):
        schedules[f"chunks seed {seed}"] = list(_chunks(ids, random.Random(seed)))
    for name, steps in schedules.items():
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(step) for step in steps]
        pieces.append(detok.flush())
        assert not any("\ufffd" in p for p in pieces), name
        assert "".join(pieces) == expected, name
        assert detok.text == expected, name


def test_byte_level_streaming_matches_one_shot(byte_level):
    ids = byte_level.encode(MULTILINGUAL)
    # The test is only meaningful if characters really are split across tokens.
    assert any("\ufffd" in byte_level.decode([i]) for i in ids)
    _assert_streams_like_one_shot(byte_level)


def test_metaspace_streaming_matches_one_shot(metaspace):
    ids = metaspace.encode(MULTILINGUAL)
    assert any("\ufffd" in metaspace.decode([i]) for i in ids)
    # ... and a token decoded alone loses its leading space.
    assert "".join(metaspace.decode([i]) for i in ids).count(" ") < MULTILINGUAL.count(" ")
    _assert_streams_like_one_shot(metaspace)


@pytest.mark.model
def test_smollm2_streaming_matches_one_shot(smollm2):
    _assert_streams_like_one_shot(smollm2)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_prompt_context_keeps_leading_space(kind, request):
    tok = request.getfixturevalue(kind)
    prompt, completion = "Answer in Русский:", " спекулятивное 🚀 decoding"
    prompt_ids = tok.encode(prompt)
    gen_ids = tok.encode(prompt + completion)[len(prompt_ids) :]
    assert tok.encode(prompt + completion)[: len(prompt_ids)] == prompt_ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    for i in gen_ids:
        detok.add([i])
    detok.flush()
    full = tok.decode(prompt_ids + gen_ids)
    assert detok.text == full[len(tok.decode(prompt_ids)) :]
    assert detok.text.startswith(" ")


def test_incomplete_character_held_until_flush(byte_level):
    ids = byte_level.encode("ok 🚀")
    partial = ids[:-1]
    assert byte_level.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_level)
    assert "\ufffd" not in detok.add(partial)
    assert detok.flush().endswith("\ufffd")
    assert detok.text == byte_level.decode(partial)


def test_special_tokens_skipped_or_kept(byte_level):
    eos = next(iter(byte_level.eos_token_ids))
    ids = byte_level.encode("中文 fox") + [eos] + byte_level.encode(" dog")
    for skip in (True, False):
        detok = IncrementalDetokenizer(byte_level, skip_special_tokens=skip)
        for i in ids:
            detok.add([i])
        detok.flush()
        assert detok.text == byte_level.decode(ids, skip_special_tokens=skip)
    assert "<|endoftext|>" in byte_level.decode(ids, skip_special_tokens=False)


class _RecordingDecoder:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.skipped_token_ids = tok.skipped_token_ids
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(byte_level):
    ids = byte_level.encode(MULTILINGUAL * 20)
    eos = next(iter(byte_level.eos_token_ids))
    recorder = _RecordingDecoder(byte_level)
    detok = IncrementalDetokenizer(recorder, prompt_ids=ids[:100])
    for step in _chunks(ids + [eos] * 50, random.Random(0)):
        detok.add(step)
    assert recorder.longest <= 20


def test_window_bounded_when_output_never_completes_a_character(byte_level):
    lead_byte = byte_level.hf.convert_tokens_to_ids("ð")  # byte 0xF0 in GPT-2's byte map
    assert byte_level.decode([lead_byte]) == "\ufffd"
    ids = [lead_byte] * 200 + byte_level.encode(" ok 🚀")
    recorder = _RecordingDecoder(byte_level)
    detok = IncrementalDetokenizer(recorder)
    for i in ids:
        detok.add([i])
    detok.flush()
    assert recorder.longest <= 40
    assert detok.text == byte_level.decode(ids)


def test_stop_string_spanning_tokens_cuts_text(byte_level):
    text = "The fox said: 中文 STOP here and more"
    ids = byte_level.encode(text)
    detok = IncrementalDetokenizer(byte_level)
    stop = StopStringMatcher(["文 ST", "never"])
    out = []
    for i in ids:
        # The stop string must not be found inside a single token for this to test anything.
        assert "文 ST" not in byte_level.decode([i])
        out.append(stop.feed(detok.add([i])))
        if stop.matched:
            break
    assert stop.matched == "文 ST"
    assert "".join(out) == "The fox said: 中"
    assert stop.feed("more text") == ""
    assert stop.flush() == ""


def test_stop_string_held_back_then_released():
    stop = StopStringMatcher(["</answer>", "\n\n"])
    assert stop.feed("result: 42 </ans") == "result: 42 "
    assert stop.held == "</ans"
    assert stop.feed("wer-ish") == "</answer-ish"
    assert stop.feed("\n") == ""
    assert stop.feed("x") == "\nx"
    assert stop.feed(" <") == " "
    assert stop.flush() == "<"
    assert stop.matched is None


def test_stop_string_earliest_match_wins():
    stop = StopStringMatcher(["cd", "b"])
    assert stop.feed("a") == "a"
    assert stop.feed("bcd") == ""
    assert stop.matched == "b"


def test_stop_string_split_over_many_chunks():
    stop = StopStringMatcher(["<|user|>"])
    out = [stop.feed(c) for c in ["Sure", "! <", "|", "us", "er", "|> ignored"]]
    assert "".join(out) == "Sure! "
    assert stop.matched == "<|user|>"


def _first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference: the text up to the stop string that ends first (the longest of
    those ending at the same character)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[:end - len(s)], s
    return text, None


def test_stop_strings_do_not_depend_on_chunking():
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        want = _first_stop(text, stops)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stop = StopStringMatcher(stops)
        out = "".join(stop.feed(c) for c in chunks) + stop.flush()
        assert (out, stop.matched) == want, (stops, chunks)


def test_long_stop_string_over_a_repeated_character():
    """The automaton's worst case for a naive rescan: a 1025-character stop string of
    one repeated character, fed one character at a time. Exactly what could still
    start a stop string is held; the rest is released as it comes."""
    stop = StopStringMatcher(["a" * 1024 + "b", "a" * 1000 + "c"])
    released = "".join(stop.feed("a") for _ in range(2000))
    assert released == "a" * (2000 - 1024) and stop.held == "a" * 1024
    assert stop.feed("b") == "" and stop.matched == "a" * 1024 + "b"
    again = StopStringMatcher(["a" * 1024 + "b", "a" * 1000 + "c"])
    assert again.feed("a" * 1500 + "c") == "a" * 500 and again.matched == "a" * 1000 + "c"


def test_no_stop_strings_passes_through():
    stop = StopStringMatcher(["", ""])
    assert stop.feed("anything") == "anything"
    assert stop.flush() == ""


@pytest.mark.model
def test_smollm2_chat_template_layout(smollm2):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    ids = smollm2.apply_chat_template(messages)
    assert smollm2.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    im_start, im_end = smollm2.encode("<|im_start|><|im_end|>")
    assert ids[0] == im_start
    assert ids.count(im_end) == 2
    assert im_end in smollm2.eos_token_ids

    no_prompt = smollm2.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt
    assert smollm2.decode(no_prompt, skip_special_tokens=False).endswith("Hi there<|im_end|>\n")

    # Without a system turn the template supplies SmolLM's default one.
    default = smollm2.decode(smollm2.apply_chat_template(messages[1:]), skip_special_tokens=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_chat_template_missing_raises(byte_level):
    with pytest.raises(ValueError, match="chat template"):
        byte_level.apply_chat_template([{"role": "user", "content": "hi"}])


def test_fingerprint_equal_for_same_vocab_and_differs_otherwise(byte_level, metaspace, tmp_path):
    byte_level.hf.save_pretrained(tmp_path / "a")
    reloaded = Tokenizer.from_dir(tmp_path / "a")
    assert reloaded.fingerprint() == byte_level.fingerprint()
    assert _byte_level_tokenizer().fingerprint() == byte_level.fingerprint()

    size, digest = byte_level.fingerprint()
    assert size == byte_level.vocab_size == len(byte_level.hf)
    assert len(digest) == 64
    assert metaspace.fingerprint() != byte_level.fingerprint()
    extended = _byte_level_tokenizer(extra_tokens=["<tool>"])
    assert extended.vocab_size == byte_level.vocab_size + 1
    assert extended.fingerprint()[1] != digest


@pytest.mark.model
def test_smollm2_fingerprint_stable(smollm2, smollm2_dir):
    assert Tokenizer.from_dir(smollm2_dir).fingerprint() == smollm2.fingerprint()
    assert smollm2.fingerprint()[0] == smollm2.vocab_size


def test_eos_ids_from_config_files(byte_level, tmp_path):
    byte_level.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == {byte_level.hf.eos_token_id, 5, 7, 9}
    assert byte_level.eos_token_ids == {byte_level.hf.eos_token_id}
