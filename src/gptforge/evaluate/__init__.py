"""Offline evaluation: LAMBADA cloze accuracy, WikiText perplexity, and an lm-eval adapter.

Data files are always the user's; nothing is downloaded. Models are used only through
`model.hidden_states(...)`, `model.logits(...)` or `model(...)`, so quantized, pruned or
otherwise wrapped models evaluate unchanged. `gptforge.evaluate.harness` (lm-eval, an optional
extra) is imported only when used.
"""

from gptforge.evaluate.common import Scored, score_sequences
from gptforge.evaluate.lambada import evaluate_lambada, read_lambada, split_passage
from gptforge.evaluate.runner import run_eval
from gptforge.evaluate.wikitext import evaluate_wikitext, wikitext_detokenize

__all__ = [
    "Scored",
    "evaluate_lambada",
    "evaluate_wikitext",
    "read_lambada",
    "run_eval",
    "score_sequences",
    "split_passage",
    "wikitext_detokenize",
]
