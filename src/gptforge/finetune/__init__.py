"""Fine-tuning for sequence classification: GLUE readers, the classifier head, metrics, the run."""

from gptforge.finetune.classifier import (
    SequenceClassifier,
    is_classifier_dir,
    load_classifier,
    save_classifier,
)
from gptforge.finetune.glue import TASKS, get_task, load_glue, read_glue

__all__ = ["TASKS", "SequenceClassifier", "finetune", "get_task", "is_classifier_dir", "load_classifier",
           "load_glue", "read_glue", "save_classifier"]


def finetune(*args, **kwargs):
    """`gptforge.finetune.run.finetune` (imported on first use)."""
    from gptforge.finetune.run import finetune as _finetune

    return _finetune(*args, **kwargs)
