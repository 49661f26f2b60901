"""Train a small MoE language model on the Python standard library and record its routing.

Legend: T steps, R ranks (8: the batch treated as 8 EP ranks), E experts (64), K top-k (8);
``counts_TRE`` int64 ``[T, R, E]`` records rank ``r``'s tokens route to expert ``e`` in step ``t``.

What it does (CPU only, offline, deterministic given ``--seed``):

1. Reads the ``.py`` files of this interpreter's standard library (``site-packages`` left out),
   sorted by path; every 10th file is held out for the inference traces. Tokens are bytes
   (vocabulary 256), so no tokenizer download is needed.
2. Builds a ``transformers`` Qwen3-MoE causal LM from a config (4 layers, hidden 128,
   64 experts of intermediate size 128, top-8, the router's auxiliary loss at Qwen3-MoE's
   default coefficient 0.001) and trains it with AdamW for ``--train-steps`` steps of
   16 sequences of 256 bytes (2 sequences per rank).
3. Records every MoE layer's top-k choices with forward hooks on the routers
   (``Qwen3MoeTopKRouter`` returns its indices) and counts them per rank, the batch's
   sequences split over the 8 ranks in order:

   * ``train``: every training step's forward (``--train-steps`` steps, 512 tokens per rank);
   * ``prefill``: after training, fresh held-out windows every step, 2 sequences of 256
     bytes per rank (512 tokens per rank), ``--infer-steps`` steps;
   * ``decode``: 16 sequences per rank, one token each per step, ``--infer-steps`` steps. Each
     sequence reads held-out text in windows of 256 bytes (a new request at every window
     boundary, the boundaries staggered over the sequences as continuous batching does);
     the token a step routes is the text's next byte (teacher forcing: real text, not the
     model's samples), routed with its window's earlier bytes as context.

Writes ``moonplan/traces/data/{kind}-l{layer}.npz`` (one int16 ``[T, 8, 64]`` array, read by
``moonplan.traces.load_counts``) and ``moonplan/traces/data/index.json`` (the settings, the
training loss and every trace's statistics: ``moonplan.traces.persistence``). 43 minutes on
one thread of this project's shared 2-core CPU (training 18, prefill 25, decode 0.5); not
part of the test suite.

    OMP_NUM_THREADS=1 python bench/make_real_traces.py            # everything
    OMP_NUM_THREADS=1 python bench/make_real_traces.py --stats    # recompute index.json only
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "moonplan" / "traces" / "data"
OUT = DATA
RANKS, EXPERTS, TOPK, LAYERS = 8, 64, 8, 4
SEQ = 256
KINDS = ("train", "prefill", "decode")


def corpus() -> tuple[bytes, bytes]:
    """``(train, held_out)`` bytes of the standard library's ``.py`` files (every 10th file
    held out), each file followed by a blank line."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held = [], []
    for i, p in enumerate(files):
        (held if i % 10 == 9 else train).append(p.read_bytes() + b"\n\n")
    return b"".join(train), b"".join(held)


def windows(text: bytes, count: int, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[count, SEQ]``: windows of ``text`` at random offsets."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    start = torch.randint(0, len(data) - SEQ, (count,), generator=gen)
    return torch.stack([data[s : s + SEQ] for s in start.tolist()]).to(torch.int64)


def build_model(seed: int) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
        router_aux_loss_coef=0.001, output_router_logits=True, max_position_embeddings=SEQ,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


class Routing:
    """Forward hooks on every router: the top-k ids of the last forward, per layer."""

    def __init__(self, model: Any) -> None:
        self.ids: dict[int, torch.Tensor] = {}
        routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
        if len(routers) != LAYERS:
            raise RuntimeError(f"expected {LAYERS} routers, found {len(routers)}")
        for i, r in enumerate(routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, layer: int) -> Any:
        def keep(module: Any, args: Any, out: Any) -> None:
            self.ids[layer] = out[2].detach().reshape(-1, TOPK)  # (tokens, K), batch-major

        return keep

    def counts(self, token_rank: torch.Tensor) -> list[torch.Tensor]:
        """int64 ``[R, E]`` per layer: the last forward's records by rank of their token."""
        out = []
        for layer in range(LAYERS):
            ids_NK = self.ids[layer]
            flat = token_rank[:, None] * EXPERTS + ids_NK
            out.append(torch.bincount(flat.reshape(-1), minlength=RANKS * EXPERTS).view(RANKS, -1))
        return out


def train(model: Any, text: bytes, steps: int, seed: int, log: dict[str, Any]) -> list[list]:
    """Train; returns each layer's ``[R, E]`` counts of every step."""
    routing = Routing(model)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    batch = 2 * RANKS
    token_rank = torch.arange(RANKS).repeat_interleave(batch // RANKS * SEQ)
    per_layer: list[list] = [[] for _ in range(LAYERS)]
    model.train()
    t0 = time.time()
    for step in range(steps):
        x = windows(text, batch, gen)
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        for layer, c in enumerate(routing.counts(token_rank)):
            per_layer[layer].append(c)
        if step % 20 == 0 or step == steps - 1:
            loss, aux = float(out.loss.detach()), float(out.aux_loss.detach())
            log.setdefault("loss", []).append([step, loss, aux])
            print(
                f"step {step:4d} loss {loss:.3f} aux {aux:.3f} {time.time() - t0:.0f}s", flush=True
            )
    return per_layer


@torch.no_grad()
def prefill(model: Any, text: bytes, steps: int, seed: int) -> list[list]:
    """Each step: 2 fresh held-out windows per rank; each layer's ``[R, E]`` counts."""
    routing = Routing(model)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = 2 * RANKS
    token_rank = torch.arange(RANKS).repeat_interleave(batch // RANKS * SEQ)
    per_layer: list[list] = [[] for _ in range(LAYERS)]
    for _ in range(steps):
        model(input_ids=windows(text, batch, gen))
        for layer, c in enumerate(routing.counts(token_rank)):
            per_layer[layer].append(c)
    return per_layer


@torch.no_grad()
def decode(model: Any, text: bytes, steps: int, seed: int) -> list[torch.Tensor]:
    """``[T, R, E]`` per layer: 16 sequences per rank, one token each per step (see the
    module docstring: staggered windows, teacher forcing)."""
    routing = Routing(model)
    gen = torch.Generator().manual_seed(seed + 2)
    slots = 16 * RANKS
    offset_S = torch.randint(0, SEQ, (slots,), generator=gen)
    counts = torch.zeros(LAYERS, steps, RANKS, EXPERTS, dtype=torch.int64)
    for slot, off in enumerate(offset_S.tolist()):  # slot s's window w covers steps
        first = -off  # [first + w*SEQ, first + (w+1)*SEQ)
        spans = range(0, off + steps, SEQ)
        x = windows(text, len(spans), gen)
        model(input_ids=x)
        for layer in range(LAYERS):
            ids = routing.ids[layer].view(len(spans), SEQ, TOPK)
            t_W = torch.arange(len(spans) * SEQ) + first
            keep = (t_W >= 0) & (t_W < steps)
            flat = ids.reshape(-1, TOPK)[keep]
            t = t_W[keep]
            counts[layer, t[:, None].expand_as(flat), slot // 16, flat] += 1
    return list(counts)


def _iter_kinds(model: Any, train_text: bytes, held: bytes, args: Any, log: dict) -> Iterator:
    yield "train", train(model, train_text, args.train_steps, args.seed, log)
    model.eval()
    t0 = time.time()
    yield "prefill", prefill(model, held, args.infer_steps, args.seed)
    log["prefill_s"] = time.time() - t0
    t0 = time.time()
    yield "decode", decode(model, held, args.infer_steps, args.seed)
    log["decode_s"] = time.time() - t0


def record(args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    t0 = time.time()
    train_text, held = corpus()
    model = build_model(args.seed)
    log: dict[str, Any] = {"corpus_bytes": [len(train_text), len(held)]}
    OUT.mkdir(parents=True, exist_ok=True)
    for kind, per_layer in _iter_kinds(model, train_text, held, args, log):
        for layer, steps in enumerate(per_layer):
            c = torch.stack(list(steps)) if not isinstance(steps, torch.Tensor) else steps
            np.savez_compressed(OUT / f"{kind}-l{layer}.npz", counts=c.numpy().astype(np.int16))
        print(f"{kind}: saved {len(per_layer)} layers, {time.time() - t0:.0f}s", flush=True)
    log["record_s"] = time.time() - t0
    return log


def stats(log: dict[str, Any]) -> None:
    """Write ``index.json``: the settings, ``log`` and every trace's statistics."""
    from moonplan.traces.files import load_counts
    from moonplan.traces.persistence import trace_stats

    traces = {}
    for path in sorted(OUT.glob("*.npz")):
        traces[path.stem] = trace_stats(load_counts(path))
        print(path.stem, json.dumps(traces[path.stem]), flush=True)
    index = {
        "format": "moonplan-real-traces-v1",
        "model": {"config": "Qwen3-MoE", "layers": LAYERS, "hidden": 128, "experts": EXPERTS,
                  "topk": TOPK, "moe_intermediate": 128, "router_aux_loss_coef": 0.001,
                  "vocab": "bytes (256)", "seq": SEQ},
        "ranks": RANKS,
        "log": log,
        "traces": traces,
    }  # fmt: skip
    (OUT / "index.json").write_text(json.dumps(index, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--infer-steps", type=int, default=1100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stats", action="store_true", help="recompute index.json only")
    ap.add_argument("--out", default=str(DATA), help="output folder")
    args = ap.parse_args()
    global OUT
    OUT = Path(args.out)
    if args.stats:
        old = json.loads((OUT / "index.json").read_text()) if (OUT / "index.json").exists() else {}
        stats(old.get("log", {}))
        return
    stats(record(args))


if __name__ == "__main__":
    main()
