"""The whole life cycle on the built-in corpus, with a report (`gptforge demo`, `make demo`).

    from gptforge.demo import Settings, run_demo
    run_demo(Settings(out="runs/demo"), run_verb)   # each stage runs its verb through run_verb

`run_verb(argv) -> exit code` is handed in from above (`gptforge demo` passes the CLI's own
entry point); nothing in this package imports the CLI.
"""

from gptforge.demo.pipeline import ROWS, DemoError, run_demo
from gptforge.demo.plan import FULL, QUICK, Settings, Shape

__all__ = ["FULL", "QUICK", "ROWS", "DemoError", "Settings", "Shape", "run_demo"]
