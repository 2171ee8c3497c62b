"""The `GPTForgeLM` class itself. Imports lm-eval at module level: import through
`gptforge.evaluate.harness.lm_class()`, which gives a clear error when lm-eval is missing."""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gptforge.errors import DataError, UsageError
from gptforge.evaluate.common import check_token_ids, model_context, model_device, score_sequences
from gptforge.progress import bar as progress_bar

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until


class GPTForgeLM(TemplateLM):
    """A gptforge model (in memory, or loaded from `ckpt=DIR`) as an lm-eval language model.

    `max_length` defaults to the model's context; `vocab_size` limits the softmax/argmax to the
    first columns (default: all the model outputs, as HF does on an exported model).
    """

    def __init__(self, model: torch.nn.Module | None = None, tokenizer=None, ckpt: str | None = None,
                 batch_size: int | str = 8, max_length: int | None = None, vocab_size: int | None = None,
                 amp_dtype: torch.dtype | None = None, device: str | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, progress: bool = True, **_ignored: Any):
        super().__init__()
        if model is None:
            if ckpt is None:
                raise UsageError("GPTForgeLM: give model= and tokenizer=, or ckpt=DIR")
            model, tokenizer = _load(ckpt, device)
        elif tokenizer is None:
            raise UsageError("GPTForgeLM: a model needs its tokenizer (tokenizer=...)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_length = int(max_length) if max_length else model_context(model)
        self.vocab_size = vocab_size
        self.amp_dtype = amp_dtype
        self._max_gen_toks = int(max_gen_toks)
        self.progress = progress  # False: no bars, whatever lm-eval's disable_tqdm says
        self._device = model_device(model)

    # --------------------------------------------------------------- lm-eval's properties
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name", "gptforge")).replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype), "model_class": type(self.model).__name__}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(Σ log p(continuation), continuation is greedy) for (key, context ids, continuation ids)."""
        L = self.max_length
        seqs, first = [], []
        for _, ctx, cont in requests:
            if not cont:
                raise DataError("lm-eval request with an empty continuation")
            if len(cont) > L:
                raise DataError(f"continuation of {len(cont)} tokens is longer than the model's window ({L})")
            full = (list(ctx) + list(cont))[-(L + 1):]
            seqs.append(full)
            first.append(len(full) - 1 - len(cont))
        check_token_ids(self.model, seqs, "lm-eval request")
        scored = score_sequences(self.model, seqs, first, batch_size=self.batch_size,
                                 max_tokens=self.batch_size * L, pad_id=self.eot_token_id,
                                 vocab_size=self.vocab_size, amp_dtype=self.amp_dtype,
                                 progress=self.progress and not disable_tqdm, desc="loglikelihood")
        out = []
        for (key, _, _), s in zip(requests, scored, strict=True):
            answer = (s.logprob, s.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings: max-length windows, each token scored once, the
        first conditioned on EOS (lm-eval's rolling windows)."""
        pairs, owner = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(pairs, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores, strict=True):
            totals[i] += lp
        for r, t in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, t)
        return totals

    # --------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with do_sample, temperature-sampled) continuation of each context, cut at
        the first stop sequence (`until`, plus EOS), at most `max_gen_toks` tokens."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        bar = progress_bar(total=len(requests), desc="generate_until", enabled=self.progress and not disable_tqdm)
        eos_text = self.tok_decode([self.eot_token_id])
        for idx in groups.values():
            kw = dict(requests[idx[0]].args[1])
            until = handle_stop_sequences(kw.pop("until", None), eos=eos_text)
            max_new = int(kw.pop("max_gen_toks", self._max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            do_sample = bool(kw.pop("do_sample", False)) and temperature > 0
            max_ctx = self.max_length - max_new
            if max_ctx < 1:
                raise UsageError(f"max_gen_toks={max_new} leaves no room for context in a "
                                 f"{self.max_length}-token window")
            # The whole group at once: the engine keeps `batch_size` of them decoding together.
            ctxs = [self.tok_encode(requests[i].args[0])[-max_ctx:] or [self.eot_token_id] for i in idx]
            for i, text in zip(idx, self._generate(ctxs, max_new, until, temperature if do_sample else 0.0),
                               strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(idx))
        bar.close()
        return out  # type: ignore[return-value]

    def _generate(self, ctxs: list[list[int]], max_new: int, until: list[str], temperature: float) -> list[str]:
        """Decoding with the engine (continuous batching of up to `batch_size` contexts), each
        continuation ending at EOS or cut before its first stop sequence."""
        from gptforge.generate.backend import TorchBackend
        from gptforge.generate.engine import SamplingParams
        from gptforge.generate.engine.offline import offline_engine, run_requests

        params = SamplingParams(max_tokens=max_new, temperature=temperature, stop=[s for s in until if s])
        with TorchBackend(self.model) as be:
            core = offline_engine(be, eos_token_ids=[self.eot_token_id], vocab_limit=self.vocab_size,
                                  max_batch_size=self.batch_size, tokenizer=self.tokenizer)
            seqs = run_requests(core, ctxs, params, keep_scores=False)  # lm-eval reads only the text
        return [s.text_state.text for s in seqs]  # the whole text, cut before a stop sequence


def _load(ckpt: str, device: str | None):
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.device import select_device
    from gptforge.model_io import load_model, resolve_checkpoint_path

    path = resolve_checkpoint_path(ckpt)
    model, cfg = load_model(path, device=select_device(device or "auto"))
    return model, load_tokenizer(cfg.Data.tokenizer, path if path.is_dir() else None)


def build_lm_class(name: str) -> type:
    """Register `GPTForgeLM` with lm-eval under `name` (once) and return it."""
    from lm_eval.api.registry import get_model

    try:
        registered = get_model(name)
    except Exception:  # noqa: BLE001 - lm-eval raises different errors for unknown names across versions
        registered = None
    if registered is not GPTForgeLM:
        register_model(name)(GPTForgeLM)
    return GPTForgeLM
