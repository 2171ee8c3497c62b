"""Byte-level BPE tokenizers in GGUF terms (llama.cpp's `gpt2` tokenizer model), both ways.

A GGUF file carries the tokenizer as metadata: `tokenizer.ggml.tokens` (id order),
`tokenizer.ggml.token_type` (NORMAL, CONTROL for special added tokens, USER_DEFINED for the
other added ones, UNUSED for holes), `tokenizer.ggml.merges` ("a b" strings in rank order),
`tokenizer.ggml.pre` = `gpt-2` (the GPT-2 split regex that every byte-level BPE of ours uses)
and the BOS/EOS ids. These are the keys llama.cpp's `convert_hf_to_gguf.py` writes for a GPT-2
vocabulary; the `gguf` package supplies the key names and the token types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gptforge.errors import CheckpointError, UsageError

TOKENIZER_MODEL = "gpt2"
PRE_TOKENIZER = "gpt-2"


@dataclass
class GGUFVocab:
    tokens: list[str]
    types: list[int]   # gguf.TokenType values
    merges: list[str]
    eos_id: int


def _bpe_json(tokenizer) -> dict:
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    pre = json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        raise UsageError(f"tokenizer {tokenizer.name!r} is a {model.get('type')} tokenizer without byte-level "
                         "pre-tokenization; the GGUF export writes byte-level BPE (GPT-2's kind) only")
    return model


def vocab_from_tokenizer(tokenizer, n_vocab: int) -> GGUFVocab:
    """The GGUF vocabulary of `tokenizer` with exactly `n_vocab` entries (holes in its id
    range become `[PAD<id>]` tokens of type UNUSED, as llama.cpp's converter writes them)."""
    import gguf

    model = _bpe_json(tokenizer)
    by_id = {int(i): tok for tok, i in tokenizer.backend.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.NORMAL))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return GGUFVocab(tokens, types, merges, int(tokenizer.eos_token_id))


def add_vocab(writer, vocab: GGUFVocab) -> None:
    """Write the tokenizer keys into a `gguf.GGUFWriter`."""
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    # GPT-2 has one special token: <|endoftext|> begins, ends and pads; no BOS is prepended.
    writer.add_bos_token_id(vocab.eos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(False)


def tokenizer_from_gguf(fields: dict, source: str):
    """Our `Tokenizer` rebuilt from a GGUF file's tokenizer keys ({key: value})."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    from gptforge.data.tokenizer import EOS_TOKEN, Tokenizer

    if fields.get("tokenizer.ggml.model") != TOKENIZER_MODEL:
        raise CheckpointError(f"{source}: tokenizer.ggml.model {fields.get('tokenizer.ggml.model')!r} is not "
                              f"{TOKENIZER_MODEL!r}; only GPT-2 byte-level BPE vocabularies import")
    tokens, types = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or []
    unused, control = 5, 3  # gguf.TokenType.UNUSED / CONTROL
    vocab = {t: i for i, t in enumerate(tokens) if not (i < len(types) and types[i] in (unused, control))}
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    backend = Backend(BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [t for i, t in enumerate(tokens) if i < len(types) and types[i] == control]
    for t in specials:  # added in id order, so each takes the next id: check that it is its own
        backend.add_special_tokens([t])
        if backend.token_to_id(t) != tokens.index(t):
            raise CheckpointError(f"{source}: control token {t!r} sits at id {tokens.index(t)} inside the BPE "
                                  "range; only vocabularies with their special tokens after the BPE ids import")
    if EOS_TOKEN not in specials:
        raise CheckpointError(f"{source}: the vocabulary has no {EOS_TOKEN} control token")
    return Tokenizer(backend, source)
