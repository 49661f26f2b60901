"""``moonplan cost``: print the EP cost figures of a model preset (see ``moonplan.cost``).

``register(subparsers)`` adds the subcommand; ``moonplan/cli/main.py`` wires it in. The table
shows parameters, weight GiB per rank and dispatch/combine MiB per rank for both backends.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from moonplan.cli.args import add_subcommand, int_range
from moonplan.cli.choices import MODEL_PRESETS, listed
from moonplan.tables import render

if TYPE_CHECKING:
    from moonplan.cost import CommPerRank, MemoryPerRank, ModelPreset, ParamCount

_BACKEND_LABELS = {  # moonplan.cost.ALL_TO_ALL, moonplan.cost.ALLGATHER_REDUCESCATTER
    "all_to_all": "direct all-to-all",
    "allgather_reducescatter": "allgather + reduce-scatter",
}


def preset_name(text: str) -> str:
    """A preset or hardware name as the tables spell it (case and blanks ignored)."""
    return text.strip().lower()


HELP = "parameters, weight memory and dispatch bytes per rank of an MoE model under EP"
DESCRIPTION = (
    "Back-of-envelope EP cost of a model preset (weights and dispatch/combine "
    "payload only; see docs/cost.md for the formulas and simplifications)."
)


def register(subparsers: Any) -> None:
    """Add the ``cost`` subcommand to an ``argparse`` subparsers object (from
    ``ArgumentParser.add_subparsers()``); its handler is stored as ``args.func``."""
    parser = add_subcommand(subparsers, "cost", handler, HELP, DESCRIPTION)
    parser.add_argument(
        "--model",
        default="mixtral-8x7b",
        type=preset_name,
        choices=MODEL_PRESETS,
        help=f"model preset, case-insensitive: {listed(MODEL_PRESETS)} (default mixtral-8x7b)",
    )
    parser.add_argument("--ep", "--ranks", type=int_range(1), default=8, help="EP size (default 8)")
    parser.add_argument(
        "--tp", type=int_range(1), default=1, help="TP of replicated params (default 1)"
    )
    parser.add_argument(
        "--tokens",
        type=int_range(0),
        default=512,
        help="tokens per rank per layer, B (default 512)",
    )
    parser.add_argument(
        "--bytes", type=int_range(1), default=2, help="bytes per element (default 2, bf16)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def handler(args: argparse.Namespace) -> int:
    """Print the cost table (or JSON with ``--json``) for ``args``; return the exit code."""
    try:
        report = cost_report(
            args.model, ep=args.ep, tp=args.tp, tokens=args.tokens, bytes_per_elem=args.bytes
        )
    except ValueError as err:
        print(f"moonplan cost: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0


def cost_report(
    name: str, *, ep: int, tp: int = 1, tokens: int = 512, bytes_per_elem: int = 2
) -> dict[str, Any]:
    """All figures for preset ``name`` as a JSON-ready dict (bytes, GiB and MiB).

    Arguments as for ``memory_per_rank``/``comm_per_rank``; ``bytes_per_elem`` is used for
    weights and activations alike. Raises ``ValueError`` on bad input.
    """
    from moonplan.cost import BACKENDS, comm_per_rank, count_params, get_preset, memory_per_rank

    s = bytes_per_elem
    model = get_preset(name)
    params = count_params(model)
    memory = memory_per_rank(model, ep=ep, tp=tp, bytes_per_param=s)
    comm = [
        comm_per_rank(model, ep=ep, tokens=tokens, bytes_per_elem=s, backend=b) for b in BACKENDS
    ]
    return {
        "model": model.name,
        "source": model.source,
        "assumptions": list(model.assumptions),
        "ep": ep,
        "tp": tp,
        "tokens_per_rank_per_layer": tokens,
        "bytes_per_element": s,
        "moe_layers": model.num_moe_layers,
        "params": _params_dict(params),
        "memory_per_rank": _memory_dict(memory),
        "comm_per_rank": {c.backend: _comm_dict(c) for c in comm},
        "notes": _notes(model, ep),
    }


def _fields(obj: object, names: dict[str, str]) -> dict[str, Any]:
    """``{key: obj.<attribute>}`` for every ``key: attribute`` of ``names``."""
    return {key: getattr(obj, attribute) for key, attribute in names.items()}


# ParamCount and MemoryPerRank fields in the JSON, space-separated
_PARAM_KEYS = "expert replicated total active attention router embedding lm_head shared_experts"
_PARAM_KEYS += " dense_ffn"
_MEMORY_KEYS = "expert_bytes replicated_bytes total_bytes expert_gib replicated_gib total_gib"
_COMM_KEYS = {  # JSON key: CommPerRank attribute
    "dispatch_bytes_per_layer": "dispatch_bytes",
    "combine_bytes_per_layer": "combine_bytes",
    "dispatch_combine_bytes_per_layer": "layer_bytes",
    "forward_bytes": "forward_bytes",
    "dispatch_mib_per_layer": "dispatch_mib",
    "dispatch_combine_mib_per_layer": "layer_mib",
    "forward_mib": "forward_mib",
}


def _params_dict(p: ParamCount) -> dict[str, int]:
    return {k: int(v) for k, v in _fields(p, {k: k for k in _PARAM_KEYS.split()}).items()}


def _memory_dict(m: MemoryPerRank) -> dict[str, float]:
    return _fields(m, {k: k for k in _MEMORY_KEYS.split()})


def _comm_dict(c: CommPerRank) -> dict[str, float]:
    return _fields(c, _COMM_KEYS)


def _notes(model: ModelPreset, ep: int) -> list[str]:
    notes = ["weights and dispatch/combine payload only: no KV cache, activations, buffers"]
    if ep > model.num_experts:
        notes.append(
            f"EP={ep} > E={model.num_experts}: some ranks hold no expert; "
            "figures use the uniform split"
        )
    if model.assumptions:
        notes.append("preset contains assumed dimensions; see docs/cost.md")
    return notes


def format_table(report: dict[str, Any]) -> str:
    """Render ``cost_report``'s dict as a readable table with units."""
    lines = [
        f"moonplan cost: {report['model']}  EP={report['ep']}  TP={report['tp']}  "
        f"B={report['tokens_per_rank_per_layer']} tokens/rank/layer  "
        f"{report['bytes_per_element']} bytes/element",
        "",
    ]
    lines += _param_lines(report["params"])
    lines += _memory_lines(report)
    lines += _comm_lines(report)
    lines += [""] + [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def _param_lines(p: dict[str, int]) -> list[str]:
    rows = [("routed experts", "expert"), ("replicated", "replicated"), ("total", "total")]
    rows.append(("active per token", "active"))
    lines = [[label, f"{p[key]:,}", f"{p[key] / 1e9:.2f}"] for label, key in rows]
    return [render(["parameters", "params", "billion"], lines), ""]


def _memory_lines(report: dict[str, Any]) -> list[str]:
    m, s = report["memory_per_rank"], report["bytes_per_element"]
    rows = [
        (f"experts x {s} bytes / EP={report['ep']}", m["expert_gib"]),
        (f"replicated x {s} bytes / TP={report['tp']}", m["replicated_gib"]),
        ("total", m["total_gib"]),
    ]
    lines = [[label, f"{gib:.2f} GiB"] for label, gib in rows]
    return [render(["weight memory per rank", "size"], lines), ""]


def _mib(value: float) -> str:
    return f"{value:.1f} MiB"


def _comm_lines(report: dict[str, Any]) -> list[str]:
    forward = f"forward x{report['moe_layers']} layers"
    lines = [
        [
            _BACKEND_LABELS[backend],
            _mib(c["dispatch_mib_per_layer"]),
            _mib(c["dispatch_combine_mib_per_layer"]),
            _mib(c["forward_mib"]),
        ]
        for backend, c in report["comm_per_rank"].items()
    ]
    title = "dispatch/combine bytes per rank, per MoE layer (uniform routing)"
    return [title, render(["backend", "dispatch", "dispatch+combine", forward], lines)]
