"""`gptforge config show|keys`: print the resolved config, or every key with its type and default."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True, parser_class=type(p))
    show = sub.add_parser("show", help="print the resolved config as YAML")
    add_config_args(show)
    show.add_argument("--world-size", type=int, default=None, help="resolve as if launched on N processes")
    keys = sub.add_parser("keys", help="list every config key with its type and default")
    keys.add_argument("section", nargs="?", help="only this section (e.g. Model)")


def run(args: argparse.Namespace) -> int:
    from gptforge.config import config_to_yaml
    from gptforge.config.docs import keys_table

    if args.action == "keys":
        print(keys_table(args.section))
        return 0
    cfg = config_from_args(args, world_size=args.world_size)
    print(config_to_yaml(cfg), end="")
    return 0
