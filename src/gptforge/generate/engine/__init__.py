"""The decoding engine: one implementation of plain and speculative decoding for every client
(`generate`, `stream`, `infer`, the lm-eval adapter, `serve`), in the split vLLM uses:

- `params.SamplingParams`: how a request is decoded (`from_generation` maps `GenerationConfig`);
- `sequence`: requests, their sequences and the events sent back;
- `scheduler`: bookkeeping only (bounded queue, admission, prefill chunks, cancellation);
- `runner`: one ragged step over any `StepBackend`'s slots;
- `sampler`: processors, warpers, greedy / sampling, log-probs (scores computed in one place);
- `spec`: speculative decoding as a proposer + verifier inside the same step;
- `output`: incremental detokenizing, stop strings, EOS, finish reasons, metrics hooks;
- `core.EngineCore` (one step), `service.EngineService` (on a thread, for servers),
  `offline` (many prompts run to completion, streaming).
"""

from gptforge.generate.engine.core import EngineCore
from gptforge.generate.engine.output import IncrementalDecoder, OutputProcessor
from gptforge.generate.engine.params import SamplingParams, from_generation
from gptforge.generate.engine.sampler import Sampler
from gptforge.generate.engine.scheduler import Scheduler, SchedulerConfig
from gptforge.generate.engine.sequence import FinishEvent, QueueFull, Request, ShuttingDown, TokenEvent
from gptforge.generate.engine.service import EngineService
from gptforge.generate.engine.spec import SpecStats

__all__ = ["EngineCore", "EngineService", "FinishEvent", "IncrementalDecoder", "OutputProcessor", "QueueFull",
           "Request", "SamplingParams", "Sampler", "Scheduler", "SchedulerConfig", "ShuttingDown", "SpecStats",
           "TokenEvent", "from_generation"]
