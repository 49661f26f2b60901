"""Record a wrapped model's routing: per layer, the all-gathered counts ``[R, E]`` of every step.

Legend:
    R ranks, E experts of a layer, T recorded steps (forward calls of that layer)
    counts_TRE  int64 records source rank ``s`` routed to expert ``e`` in step ``t``

The counts are the ones each layer's planner saw (``last_plan.counts``), identical on
every rank, so recording costs no communication; their experts are model ids (a layer
with a ``home_order`` plans in labels: its columns are put back in model-id order, so a
trace does not depend on the order it was recorded under and can give the next one,
:func:`moonplan.plan.home_order.popular_order`). Files (written by rank 0):

* ``directory/layer-{i:03d}.npy`` (or ``.json``): layer ``i``'s ``[T, R, E]`` trace, in the
  :func:`moonplan.traces.save_counts` format, readable by ``moonplan plan FILE --step t``,
  :func:`moonplan.traces.load_counts` and :func:`moonplan.simulate.workload.recorded_counts`;
* ``directory/layers.json``: ``{"format": FORMAT, "layers": [{"index", "name", "file",
  "steps", "ranks", "experts"}, ...]}``, mapping files to module names.

Each forward of a layer is one step (micro-batches are separate steps; activation
recomputation would record a step twice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from moonplan.adapters.model import sharded_experts
from moonplan.core.sharded import ShardedExperts
from moonplan.plan.plan_type import Plan
from moonplan.traces.files import load_counts, save_counts

FORMAT = "moonplan-routing-trace-v1"
INDEX = "layers.json"


class TraceRecorder:
    """Records ``[R, E]`` counts per wrapped layer and step while enabled.

    Use as a context manager (hooks removed on exit) or call :meth:`close`::

        with TraceRecorder(model) as rec:
            for batch in loader: train_step(model, batch)
        rec.save("trace/")        # rank 0 writes; other ranks return without writing

    Every layer's runtime tells the recorder each step's plan
    (``LayerRuntime.plan_listeners``), whatever its front end: ``wrap_model``'s and
    ``wrap_experts``' layers, a :class:`~moonplan.MoonMoE`, torchtitan's experts.

    Args:
        model: a model wrapped by :func:`moonplan.wrap_model` (or one wrapped block, or a
            ``MoonMoE``).

    Raises:
        ValueError: ``model`` has no wrapped experts.
    """

    def __init__(self, model: nn.Module):
        layers = list(sharded_experts(model))
        self.names = [name for name, _ in layers]
        if not self.names:
            raise ValueError(f"{type(model).__name__} has no wrapped experts to record")
        self._steps: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self._rank = layers[0][1].group.rank
        # (a runtime's listeners, ours)
        self._listening: list[tuple[list[Callable[[Plan], None]], Callable[[Plan], None]]] = []
        for name, ex in layers:
            listen = self._listener(name, ex)
            ex.runtime.plan_listeners.append(listen)
            self._listening.append((ex.runtime.plan_listeners, listen))

    def _listener(self, name: str, module: ShardedExperts) -> Callable[[Plan], None]:
        def record(plan: Plan) -> None:
            counts_RE = plan.counts.detach()
            label_E = module.runtime.label_E  # model id -> label (None: the identity)
            if label_E is not None:
                counts_RE = counts_RE.index_select(1, label_E.to(counts_RE.device))
            self._steps[name].append(counts_RE.to("cpu", torch.int64))

        return record

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording (what was recorded stays available)."""
        for listeners, listen in self._listening:
            listeners.remove(listen)
        self._listening = []

    def clear(self) -> None:
        """Forget every recorded step."""
        for steps in self._steps.values():
            steps.clear()

    def counts(self, name: str | None = None) -> torch.Tensor:
        """int64 ``[T, R, E]``: the recorded steps of one layer (default: the first).

        Raises:
            KeyError: unknown layer name.
            ValueError: nothing recorded for that layer.
        """
        steps = self._steps[name if name is not None else self.names[0]]
        if not steps:
            raise ValueError(f"no step recorded for layer {name or self.names[0]!r}")
        return torch.stack(steps)

    def save(self, directory: str | Path, *, suffix: str = ".npy") -> Path | None:
        """Write one ``[T, R, E]`` file per layer and ``layers.json`` (rank 0 only).

        Layers without a recorded step are skipped. Returns the index file's path on rank 0,
        ``None`` elsewhere.
        """
        if self._rank != 0:
            return None
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        layers = []
        for i, name in enumerate(self.names):
            if not self._steps[name]:
                continue
            counts_TRE = self.counts(name)
            file = f"layer-{i:03d}{suffix}"
            save_counts(out / file, counts_TRE)
            T, R, E = counts_TRE.shape
            layers.append(
                {"index": i, "name": name, "file": file, "steps": T, "ranks": R, "experts": E}
            )
        index = out / INDEX
        index.write_text(json.dumps({"format": FORMAT, "layers": layers}, indent=1) + "\n")
        return index


def load_trace(directory: str | Path) -> dict[str, torch.Tensor]:
    """``{layer name: counts [T, R, E]}`` from a directory written by :meth:`TraceRecorder.save`."""
    d = Path(directory)
    index = json.loads((d / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{d / INDEX} is not a {FORMAT} index")
    return {layer["name"]: load_counts(d / layer["file"]) for layer in index["layers"]}
