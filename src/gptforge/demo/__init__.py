"""The whole life cycle on the built-in corpus, with a report (`gptforge demo`, `make demo`).

    from gptforge.cli import main
    from gptforge.demo import Settings, run_demo
    run_demo(Settings(out="runs/demo"), run_verb=main)   # each stage runs its verb through main
"""

from gptforge.demo.pipeline import ROWS, DemoError, run_demo
from gptforge.demo.plan import FULL, QUICK, Settings, Shape

__all__ = ["FULL", "QUICK", "ROWS", "DemoError", "Settings", "Shape", "run_demo"]
