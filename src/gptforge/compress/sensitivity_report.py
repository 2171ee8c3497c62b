"""What a sensitivity analysis writes: the reference's `analysis.txt`, a bar chart of the ranking,
and the `skip_tensor_map` that leaves the top-k layers float in the next QAT run."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from gptforge.compress.sensitivity import Analysis, LayerResult
from gptforge.evaluate.common import write_atomic
from gptforge.transforms.quant import _OURS, LAYER_KINDS

TXT, JSON_FILE, PNG, SKIP_YAML = "analysis.txt", "analysis.json", "analysis.png", "skip_tensor_map.yaml"


# ------------------------------------------------------------------------- analysis.txt


def analysis_lines(analysis: Analysis) -> list[str]:
    """The reference's lines, most sensitive first. qat mode: AnalysisQAT's
    `Without quant layer name: linear_31.w_0, sensitive metric: 2.1`; ptq mode: the later
    `Analysis`'s `layer name: ..., sensitivity metric: ...`."""
    fmt = ("Without quant layer name: {}, sensitive metric: {}" if analysis.mode == "qat"
           else "layer name: {}, sensitivity metric: {}")
    return [fmt.format(r.weight_name, r.sensitivity) for r in analysis.ranked()]


def table_lines(analysis: Analysis, limit: int | None = None) -> list[str]:
    """A readable ranking with both names: rank, reference name, ours, metric, sensitivity."""
    ranked = analysis.ranked()
    what = "without its quant" if analysis.mode == "qat" else "only it quantized"
    out = [f"{'rank':>4}  {'reference':<12} {'ours':<24} {analysis.metric + ' ' + what:>24}  {'sensitivity':>12}"]
    for i, r in enumerate(ranked[:limit] if limit else ranked, 1):
        out.append(f"{i:>4}  {r.reference_name:<12} {r.name:<24} {r.value:>24.6g}  {r.sensitivity:>+12.6g}")
    if limit and len(ranked) > limit:
        out.append(f"      ... {len(ranked) - limit} more in {TXT} / {JSON_FILE}")
    return out


# ------------------------------------------------------------------------ skip_tensor_map


def skip_tensor_map(names: Iterable[str], base: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """`{block_i: [kinds]}` leaving the named layers (our names) float, merged into `base`
    (an existing map keeps its layers float too); blocks in order, kinds in model order."""
    found: dict[int, set[str]] = {}
    for key, kinds in (base or {}).items():
        found.setdefault(int(str(key).split("_")[1]), set()).update(kinds)
    for n in names:
        m = _OURS.match(n)
        if m is None:
            raise ValueError(f"{n!r} is not a block Linear name")
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return {f"block_{i}": [k for k in LAYER_KINDS if k in found[i]] for i in sorted(found)}


def flow_map(m: dict[str, list[str]]) -> str:
    """The map as one YAML flow mapping: `{block_3: [linear2], block_5: [linear1]}`."""
    return "{" + ", ".join(f"{k}: [{', '.join(v)}]" for k, v in m.items()) + "}"


def override_arg(m: dict[str, list[str]]) -> str:
    """The `-o` argument (shell-quoted) setting `Compress.Quantization.skip_tensor_map`."""
    return f"'Compress.Quantization.skip_tensor_map={flow_map(m)}'"


def skip_yaml(m: dict[str, list[str]], chosen: list[LayerResult], analysis: Analysis) -> str:
    """A config snippet (a valid config file on its own) with the map and why each layer is in it."""
    lines = [f"# gptforge analyze ({analysis.mode} mode, metric {analysis.metric}): the {len(chosen)} most "
             "sensitive quantized layers stay float",
             "# (merge into your QAT config, or pass the same map with -o Compress.Quantization.skip_tensor_map=...)"]
    lines += [f"#   {r.reference_name:<10} {r.name:<24} sensitivity {r.sensitivity:+.6g}" for r in chosen]
    lines += ["Compress:", "  Quantization:", "    skip_tensor_map:"]
    lines += [f"      {k}: [{', '.join(v)}]" for k, v in m.items()] or ["      {}"]
    return "\n".join(lines) + "\n"


def suggest_k(analysis: Analysis, share: float = 0.5) -> int:
    """Smallest k whose top-k layers carry `share` of the summed positive sensitivity (0 when no
    layer has a positive one)."""
    pos = [r.sensitivity for r in analysis.ranked() if r.sensitivity > 0]
    total = sum(pos)
    if total <= 0:
        return 0
    acc = 0.0
    for k, s in enumerate(pos, 1):
        acc += s
        if acc >= share * total - 1e-12 * total:
            return k
    return len(pos)


# ------------------------------------------------------------------------------ the chart


_COLORS = {"qkv_proj": "#4C72B0", "out_proj": "#55A868", "linear1": "#DD8452", "linear2": "#C44E52"}


def plot_ranking(analysis: Analysis, path: str | os.PathLike, title: str | None = None) -> Path:
    """A horizontal bar chart of the ranking (most sensitive at the top), coloured by projection kind."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    ranked = analysis.ranked()
    labels = [f"{r.reference_name}  {r.name}" for r in ranked]
    kinds = [_OURS.match(r.name).group(2) for r in ranked]
    fig, ax = plt.subplots(figsize=(8.0, max(2.5, 0.24 * len(ranked) + 1.4)))
    try:
        y = list(range(len(ranked)))[::-1]
        ax.barh(y, [r.sensitivity for r in ranked], color=[_COLORS[k] for k in kinds])
        ax.set_yticks(y, labels, fontsize=7 if len(ranked) > 40 else 8)
        ax.axvline(0.0, color="black", linewidth=0.6)
        what = "without its quantization" if analysis.mode == "qat" else "only it quantized"
        ax.set_xlabel(f"sensitivity ({analysis.metric}; {what}); larger = more sensitive")
        ax.set_title(title or f"quantization sensitivity ({analysis.mode} mode, {analysis.metric})", fontsize=10)
        ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k in kinds], fontsize=8,
                  loc="lower right")
        fig.tight_layout()
        return write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
