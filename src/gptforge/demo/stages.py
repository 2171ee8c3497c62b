"""What the demo runs and shows: the stage count, the report's model rows, command lines.

Shared by the pipeline (which runs the stages) and the report (which shows them), so that neither
imports the other."""

from __future__ import annotations

import shlex

STAGES = 15  # run_demo's stages, the report included

# Rows of the report: key -> (label, model directory kind)
ROWS = {
    "float": "float (pretrained)",
    "ptq": "PTQ INT8",
    "qat": "QAT INT8",
    "qat_skip": "QAT INT8 after analysis",
    "pruned": "pruned + fine-tuned",
    "pruned_qat": "pruned + QAT INT8",
}


def command_line(argv: list[str]) -> str:
    """`gptforge ...` as a user would type it."""
    return " ".join(["gptforge", *(shlex.quote(str(a)) for a in argv)])
