"""`gptforge config list|show|keys`: the packaged recipes, the resolved config, every key."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_sampling_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True, parser_class=type(p))
    sub.add_parser("list", help="list the recipes shipped with gptforge (use one with -c NAME)")
    show = sub.add_parser(
        "show", help="print the config as YAML that loads back with -c (derived values as comments)")
    add_config_args(show)
    add_sampling_args(show)  # what `generate --top-k 50 ...` would run with
    show.add_argument("--world-size", type=int, default=None, help="resolve as if launched on N processes")
    show.add_argument("--resolved", action="store_true",
                      help="write derived values in place (what a checkpoint's config.yaml holds) instead of "
                           "as comments; such a file pins batch sizes, ffn width and decay steps")
    show.add_argument("--path", action="store_true", help="print where the -c file or recipe is, not its config")
    keys = sub.add_parser("keys", help="list every config key with its type and default")
    keys.add_argument("section", nargs="?", help="only this section (e.g. Model)")


def _list() -> int:
    from gptforge.config.recipes import list_recipes

    recipes = list_recipes()
    width = max((len(r.name) for r in recipes), default=0)
    for r in recipes:
        print(f"{r.name:<{width}}  {r.description}")
    print("\nUse one with -c NAME (e.g. gptforge pretrain -c pretrain_gpt_tiny_cpu); "
          "`gptforge config show -c NAME > my.yaml` gives a copy to edit.")
    return 0


def run(args: argparse.Namespace) -> int:
    import copy

    from gptforge.config import config_to_yaml, resolve
    from gptforge.config.docs import keys_table
    from gptforge.config.loader import load_given
    from gptforge.config.recipes import locate
    from gptforge.config.show import annotated_yaml
    from gptforge.errors import UsageError
    from gptforge.model_io import checkpoint_config

    if args.action == "list":
        return _list()
    if args.action == "keys":
        print(keys_table(args.section))
        return 0
    if args.path:
        if not args.config:
            raise UsageError("--path needs -c FILE or a recipe NAME")
        print(locate(args.config).resolve())
        return 0
    ckpt_dir = getattr(args, "ckpt", None)
    given = load_given(args.config, args.override, checkpoint_config(ckpt_dir) if ckpt_dir else None)
    resolved = resolve(copy.deepcopy(given), world_size=args.world_size)
    print(config_to_yaml(resolved) if args.resolved else annotated_yaml(given, resolved), end="")
    return 0
