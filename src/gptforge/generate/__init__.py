"""Text generation: sampling, greedy and beam search over a preallocated KV cache.

- `generate(model, tokenizer, prompts, config)` → `GenerationResult` (texts, token ids, scores)
- `stream(model, tokenizer, prompt, config)` → iterator of text deltas
- `generate_chat(model, tokenizer, conversations, config)` → answers rendered by the chat template
- `generate_ids(model, prompt_ids, config)` → `SearchOutput` on token ids
- `load_runnable(path)` → (model or ONNX backend, config, tokenizer); `load_draft(path, tokenizer=)`
- `engine`: the decoding engine every client runs (continuous batching, speculative decoding);
- `processors`: composable logits processors; `backend.StepBackend`: the step interface the
  decode loops run on (our GPT via `TorchBackend`, or an ONNX Runtime model).
"""

from gptforge.generate.api import (
    GenerationResult,
    IncrementalDecoder,
    TextStream,
    check_config,
    generate,
    generate_chat,
    generate_ids,
    stream,
)
from gptforge.generate.backend import StepBackend, TorchBackend, release_packed
from gptforge.generate.engine import SamplingParams, SpecStats
from gptforge.generate.loader import load_draft, load_runnable
from gptforge.generate.processors import (
    NO_TOKEN,
    MinNewTokens,
    ProcessorList,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    VocabLimit,
)
from gptforge.generate.search import PromptBatch, SearchOutput, left_pad

__all__ = [
    "GenerationResult", "IncrementalDecoder", "TextStream", "check_config", "generate", "generate_chat", "generate_ids",
    "stream",
    "StepBackend", "TorchBackend", "release_packed", "NO_TOKEN", "MinNewTokens", "ProcessorList", "RepetitionPenalty",
    "Temperature", "TopK", "TopP", "VocabLimit", "PromptBatch", "SearchOutput", "left_pad", "SamplingParams",
    "SpecStats", "load_draft", "load_runnable",
]
