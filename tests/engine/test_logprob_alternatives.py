"""The embedded engine lists the most likely tokens at each position (chat's `top_logprobs`,
completions' `logprobs: k`), from the distribution whose logprob the sampled token reports, and
shows each token as OpenAI does: its decoded text and its exact bytes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from tests.embedded_support import ServedEngine
from tests.engine.test_embedded import chat, complete, recomputed_logits

FRENCH = [{"role": "user", "content": "Écris « café crème à 3 € » en français, avec les accents."}]


def _policy(
    served: ServedEngine, prompt: list[int], response: list[int], temperature: float
) -> Any:
    return torch.log_softmax(recomputed_logits(served.engine, prompt, response) / temperature, -1)


def test_chat_alternatives_are_the_policys_most_likely_tokens(embedded: ServedEngine) -> None:
    answer = chat(
        embedded, FRENCH, max_tokens=12, logprobs=True, top_logprobs=4, temperature=0.7, seed=3
    )
    choice = answer["choices"][0]
    tokens = choice["token_ids"]
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(tokens)
    policy = _policy(embedded, answer["prompt_token_ids"], tokens, 0.7)
    texts = embedded.engine.token_texts
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        values, best = policy[position].topk(4)
        alternatives = entry["top_logprobs"]
        assert [texts.text(i) for i in best.tolist()] == [a["token"] for a in alternatives]
        assert [a["logprob"] for a in alternatives] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry["logprob"] == pytest.approx(float(policy[position, token]), abs=1e-4)
        # The sampled token, when listed, has the logprob it reports itself.
        listed = {a["token"]: a["logprob"] for a in alternatives}
        if token in best.tolist():
            assert listed[entry["token"]] == pytest.approx(entry["logprob"], abs=1e-6)


def test_greedy_tokens_are_their_first_alternative(embedded: ServedEngine) -> None:
    choice = chat(embedded, FRENCH, max_tokens=8, logprobs=True, top_logprobs=2, temperature=0)[
        "choices"
    ][0]
    for entry in choice["logprobs"]["content"]:
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert entry["top_logprobs"][1]["logprob"] <= entry["logprob"]


def test_token_bytes_join_into_the_answers_text(embedded: ServedEngine) -> None:
    """Accented letters and the euro sign span several bytes; a byte-level token may hold part
    of one: its bytes are still exact (not those of U+FFFD)."""
    choice = chat(embedded, FRENCH, max_tokens=40, logprobs=True, temperature=0)["choices"][0]
    entries = choice["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    content = choice["message"]["content"]
    assert any(ord(c) > 127 for c in content), content  # the check covers multi-byte text
    assert joined.decode() == content
    # The vocabulary's piece (GPT-2's "Ġ" for a space) is not shown.
    assert all("Ġ" not in e["token"] for e in entries)


def test_zero_alternatives_are_empty_lists(embedded: ServedEngine) -> None:
    choice = chat(embedded, FRENCH, max_tokens=3, logprobs=True, top_logprobs=0)["choices"][0]
    assert [e["top_logprobs"] for e in choice["logprobs"]["content"]] == [[], [], []]


def test_completion_alternatives_include_the_sampled_token(embedded: ServedEngine) -> None:
    prompt = embedded.engine.tokenizer.encode("Le café de la gare coûte")
    choice = complete(embedded, prompt, max_tokens=8, logprobs=2, temperature=1.0, seed=9)[
        "choices"
    ][0]
    logprobs, tokens = choice["logprobs"], choice["token_ids"]
    policy = _policy(embedded, prompt, tokens, 1.0)
    texts = embedded.engine.token_texts
    assert logprobs["tokens"] == [texts.text(t) for t in tokens]
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == offsets
    for position, token in enumerate(tokens):
        values, best = policy[position].topk(2)
        expected = {texts.text(i): v for i, v in zip(best.tolist(), values.tolist(), strict=True)}
        expected[texts.text(token)] = float(policy[position, token])
        shown = logprobs["top_logprobs"][position]
        assert shown.keys() == expected.keys()
        assert list(shown.values()) == pytest.approx(list(expected.values()), abs=1e-4)


def test_a_token_holding_part_of_a_character_starts_where_the_character_does(
    embedded: ServedEngine,
) -> None:
    """`text_offset` indexes `text`: "你" is two tokens here, both at 0 (the tokens' own texts,
    one U+FFFD each, added up to offsets past the text's end)."""
    prompt = "Q: Say 你好 and 😀\nA:"
    constrained = {"structured_outputs": {"regex": "你好😀"}, "temperature": 0, "logprobs": 0}
    choice = complete(embedded, prompt, max_tokens=6, **constrained)["choices"][0]
    texts = embedded.engine.token_texts
    raw = [bytes(texts(token)[1]) for token in choice["token_ids"]]
    assert b"".join(raw).startswith("你好".encode()), choice
    whole = [len(b"".join(raw[:i]).decode(errors="ignore")) for i in range(len(raw))]
    assert choice["logprobs"]["text_offset"] == whole
    assert whole[:2] == [0, 0] and max(whole) < len(choice["text"])


def test_a_completion_without_logprobs_lists_no_alternatives(embedded: ServedEngine) -> None:
    choice = complete(embedded, "Le café", max_tokens=3, temperature=0)["choices"][0]
    assert choice["logprobs"]["top_logprobs"] is None


@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
def test_streamed_alternatives_equal_the_whole_answers(embedded: ServedEngine, route: str) -> None:
    body: dict[str, Any] = {"model": embedded.name, "max_tokens": 10, "temperature": 0}
    if route == "/chat/completions":
        body |= {"messages": FRENCH, "logprobs": True, "top_logprobs": 3}
    else:
        body |= {"prompt": "Le café de la gare coûte", "logprobs": 3}
    whole = httpx.post(embedded.base_url + route, json=body, timeout=120).json()["choices"][0]
    streamed: dict[str, list[Any]] = {}
    with httpx.stream(
        "POST", embedded.base_url + route, json=body | {"stream": True}, timeout=120
    ) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            logprobs = json.loads(line[6:])["choices"][0]["logprobs"] or {}
            for key, values in logprobs.items():
                streamed.setdefault(key, []).extend(values)
    assert streamed == whole["logprobs"]


@pytest.mark.parametrize("text", ["日本", "🙂"])
def test_a_token_holding_part_of_a_character_shows_its_own_bytes(
    embedded: ServedEngine, text: str
) -> None:
    """The default tokenizer splits these characters' UTF-8 across tokens."""
    texts = embedded.engine.token_texts
    shown = [texts(token) for token in embedded.engine.tokenizer.encode(text)]
    assert len(shown) > 1
    assert b"".join(bytes(raw) for _, raw in shown) == text.encode()
    assert "\ufffd" in shown[0][0]  # the first token alone is no whole character


def sentencepiece_style_tokenizer() -> Any:
    """A tokenizer built as Llama 2's is (pieces with "▁" for a space, `<0xNN>` byte pieces for
    characters outside its vocabulary, a decoder that strips the first space), with a tiny
    vocabulary: no such tokenizer is on this machine."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "▁", "h", "e", "l", "o", "w", "r", "d"]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    vocab |= {f"<0x{byte:02X}>": len(pieces) + byte for byte in range(256)}
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    vocab |= {"▁h": 300, "▁he": 301, "▁hel": 302, "▁hell": 303}
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_sentencepiece_tokens_keep_their_space_and_their_own_bytes() -> None:
    """Decoded alone, "▁hello" lost its space and a byte piece was U+FFFD's three bytes."""
    from reins.engine.token_text import TokenTexts

    tokenizer = sentencepiece_style_tokenizer()
    text = "hello world €"
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = TokenTexts(tokenizer)
    shown = [texts(token) for token in ids]
    assert tokenizer.decode(ids) == text
    assert shown[0] == (" hello", list(b" hello"))  # the piece "▁hello"
    assert b"".join(bytes(raw) for _, raw in shown) == f" {text}".encode()
    assert [raw for _, raw in shown[-3:]] == [[byte] for byte in "€".encode()]
    assert texts(tokenizer.eos_token_id) == ("</s>", list(b"</s>"))
