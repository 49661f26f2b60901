"""The ``resident`` candidate: balance through the replicas already in ``previous``'s slots.

Legend:
    R ranks    E experts    B slots    M = ceil(E/R)    S = 2**16 units per tile
    t          the GEMM tile in rows (``StepCost.tile_rows``; 1 balances records)
    T[e]       records of expert ``e``      K[e] = ceil(T[e] / t), its tiles
    holder     ``(e, r)``: ``r`` is expert ``e``'s home, or ``e`` is in one of ``r``'s first
               ``M`` previous slots (a rank holds an expert at most once)
    a[e][r]    tiles of ``e`` on holder ``(e, r)``, in units of ``1/S`` tile
    L[r]       the units rank ``r`` holds (the sum of its holders')
    pair       ``(e, r, g)``: two holders of one expert, ``r != g``

No weight moves: an expert's records go only to its holders. The rule balances whole
tiles of ``t`` rows (``t = 1``: records). A rank's experts phase runs each expert's rows
padded up to a GEMM tile, so a few records sent to a replica cost it a whole tile:
balancing records split a cold expert of 30 records over its two holders and padded both
halves (DeepSeek-V3 on ``h20-node`` at decode sizes: 6 tiles a rank where 5 were
possible). Balancing tiles gathers rows on fewer ranks, which dispatch and combine pay for,
so the candidate is the faster of the two by the cost model (``reference._resident``;
``docs/planner-policy.md``, "Whole tiles"). The rule is a diffusion over the holders, in
integers so that every rank computes the same plan:

1. **Start.** Each expert's ``K[e]`` tiles split evenly over its holders (in units; the
   first ``K[e]*S mod n[e]`` holders, by rank, get one unit more).
2. **Rounds** (as many as pay, below). A pair ``(e, r, g)`` is live when ``L[r] > L[g]``
   and ``a[e][r] > 0``. ``deg[x]`` counts the live pairs rank ``x`` is in (as either side),
   ``n[e][r]`` those that leave holder ``(e, r)``. Every live pair moves at once
   ``min((L[r] - L[g]) // (max(deg[r], deg[g]) + 1), a[e][r] // n[e][r])`` units from
   ``r`` to ``g``, all from the same snapshot. A rank sends less than the mean of its gaps
   to lower ranks and receives less than the mean of its gaps from higher ones, so no rank
   rises above the largest load or falls below the least: the largest load never grows,
   and moves flow across several hops over the rounds (an expert held by ``r`` and ``x``,
   another by ``x`` and ``g``, balance ``r`` with ``g``). The ``+ 1`` makes two ranks
   that share one expert meet halfway; without it they swapped their loads every round
   and the largest never fell (two ranks, one shared expert: an even number of rounds
   ended where it started).
3. **Whole tiles.** Each holder keeps ``a // S`` tiles; each expert's tiles left over go,
   one each, to its holders with the largest remainders (ties: lower rank).
4. **Rows.** The holders of ``e``, by rank, fill their tiles in turn with ``T[e]``'s
   records: each gets ``t`` rows a tile but the last holder with tiles, which gets the rest
   (at least one row). A holder's padded rows are then exactly ``t`` times its tiles, and
   the expert's add up to ``t * K[e]``, the least its records allow.

Only a rank's first ``M`` slots take records, so it runs at most ``M`` remote experts
(invariant 3). Every round is elementwise work and sums over the pairs, no sequential
scan.

**How many rounds.** Each round costs the device ``StepCost.round_s`` and lowers the
largest load or leaves it (never raises it). A round pays where the rows it takes off the
largest rank are worth more than that: ``d`` units are ``d * t / S`` rows, each worth at
most ``row_s = max(row_flop_s, row_mem_s)`` of that rank's experts phase. So the rounds
run while the last one lowered the largest load by at least :func:`least_units`
(``ceil(round_s * S / (t * row_s))``, at least one unit), or left it with fewer ranks at it
(:func:`paid`: ranks tied at the top shed one after another, and the largest load falls
only when the last of them does), and stop at the first round that did neither (its result
is kept: its price is paid), or after :data:`ROUND_LIMIT`. The last round's drop stands for
the next one's: an estimate (a diffusion's drops mostly shrink, but a round can also free
a later one's), which spares the rounds that would not pay. Without a cost model the
rounds run while the largest load falls (or its ties shrink). A step far from balance
(large and skewed) runs many rounds; a small step, whose largest load is a few tiles above
the least, stops after one or two, so the planning charge follows what the rounds buy.
Each form reports the rounds it ran, and whoever runs the step charges them
(``Choice.rounds``).

How close the rounds come to the least largest load the holders allow (a max-flow bound,
``moonplan.testing.bounds``) depends on how well the holders connect the ranks, how far
the start is from balance, and on where the rounds stop: ``bench/bench_resident_gap.py``
measures it on the tables ``moonplan-auto`` serves in the simulator (``docs/benchmarks.md``).
The bound is in tiles; rounding to whole tiles adds at most one tile a rank for each expert
whose tiles it shares with another holder.

Four forms with equal results and rounds: plain Python (:func:`resident_reference`, the
definition), numpy over the list of pairs (:func:`resident_host`, the host path's), torch
dense over ``[E, R, R]`` (any device, no host read, :func:`resident_torch`: it runs all
:data:`ROUND_LIMIT` rounds, those after the stop masked, so its device work is fixed) and
torch over the list of pairs (:func:`resident_tables_torch`, many tables at once); the
CUDA kernel is a fifth (``csrc/choice_kernel.cu``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moonplan.stepcost.step_cost import StepCost

ROUND_LIMIT = 32
"""The most rounds one build runs (the loop bound of the torch and CUDA forms; the rounds
usually stop earlier, module docstring). Each round is charged, so the limit bounds the
charge (``32 * round_s`` a rounding); where the simulator's skewed tables reach it (sigma 2)
the rounds end 0.6-1.8% above the holders' bound (``docs/benchmarks.md``, "Rounds that pay
for themselves")."""

NEVER = 1 << 62
""":func:`least_units` where no round can pay (rows cost nothing): one round only."""

SCALE_BITS = 16
"""Units per tile: ``S = 2**SCALE_BITS`` (fine enough that a gap of one tile still moves
over a rank's few hundred live pairs)."""

FINE_LIMIT_BITS = 46
"""With ``N >= 2**FINE_LIMIT_BITS`` records a unit is one tile (:func:`scale_bits`): the
units stay below ``2**62`` and no sum of them overflows int64 (there are no more tiles
than records)."""


def least_units(cost: StepCost | None, tile: int, bits: int) -> int:
    """The least drop of the largest load, in units (``2**-bits`` tile of ``tile`` rows),
    for which one more round pays (module docstring): ``ceil(round_s * 2**bits / (tile *
    row_s))``, at least 1; 1 without a cost or a round price (the rounds run while the
    largest load falls); :data:`NEVER` where rows cost nothing. Float64 in this order, as
    the CUDA kernel computes it."""
    if cost is None or cost.round_s <= 0:
        return 1
    row_s = max(cost.row_flop_s, cost.row_mem_s)
    if row_s <= 0:
        return NEVER
    q = cost.round_s * float(1 << bits) / (float(tile) * row_s)
    return NEVER if q >= float(NEVER) else max(1, math.ceil(q))


def scale_bits(num_records: int) -> int:
    """Bits of a unit below one tile for ``N`` records: :data:`SCALE_BITS`, or 0 from
    ``2**FINE_LIMIT_BITS`` records on."""
    return SCALE_BITS if num_records < 1 << FINE_LIMIT_BITS else 0


def resident_reference(
    counts: list[list[int]],
    prev_slots: list[list[int]] | None,
    home: list[int],
    tile: int = 1,
    cost: StepCost | None = None,
) -> tuple[list[list[int]], int]:
    """The ``resident`` allocation ``[E][R]`` in records (plain Python, the definition) and
    the rounds it ran; ``tile``: the GEMM tile ``t`` in rows; ``cost``: what a round costs
    and a row is worth (:func:`least_units`)."""
    R, E = len(counts), len(counts[0])
    T = [sum(row[e] for row in counts) for e in range(E)]
    K = [-(-x // tile) for x in T]
    hold = _holders_reference(E, R, prev_slots, home)
    bits = scale_bits(sum(T))
    a = [[0] * R for _ in range(E)]
    for e in range(E):
        n, units = len(hold[e]), K[e] << bits
        for i, r in enumerate(hold[e]):
            a[e][r] = units // n + (1 if i < units % n else 0)
    least, rounds = least_units(cost, tile, bits), 0
    top = _top(_loads_reference(a, R))
    while rounds < ROUND_LIMIT:
        _round_reference(a, hold, R)
        rounds += 1
        last, top = top, _top(_loads_reference(a, R))
        if not paid(last, top, least):  # the next round would not pay either
            break
    tiles = _whole_tiles_reference(a, hold, K, bits)
    return _rows_reference(tiles, hold, T, tile), rounds


def paid(last: tuple[int, int], now: tuple[int, int], least: int) -> bool:
    """Whether a round paid for itself (module docstring, "How many rounds"): from
    ``last`` to ``now`` (each the largest load and how many ranks hold it) the largest load
    fell by at least ``least`` units, or stayed with fewer ranks at it (a tie that the next
    rounds break); never where no round can pay (``least`` is :data:`NEVER`)."""
    drop = last[0] - now[0]
    return least < NEVER and (drop >= least or (drop == 0 and now[1] < last[1]))


def _top(loads: list[int] | np.ndarray) -> tuple[int, int]:
    """The largest load and how many ranks hold it."""
    top = int(max(loads))
    return top, sum(1 for x in loads if x == top)


def _loads_reference(a: list[list[int]], R: int) -> list[int]:
    """``L[r]``: the units each rank holds."""
    return [sum(a[e][r] for e in range(len(a))) for r in range(R)]


def _holders_reference(
    E: int, R: int, prev_slots: list[list[int]] | None, home: list[int]
) -> list[list[int]]:
    """Each expert's holder ranks, ascending."""
    M = -(-E // R)
    hold = [{home[e]} for e in range(E)]
    for r, row in enumerate(prev_slots or []):
        for e in row[:M]:
            if 0 <= e < E:
                hold[e].add(r)
    return [sorted(h) for h in hold]


def _round_reference(a: list[list[int]], hold: list[list[int]], R: int) -> None:
    """One round of moves, every pair's from the same snapshot (module docstring)."""
    L = _loads_reference(a, R)
    live = [(e, r, g) for e, hs in enumerate(hold) for r in hs for g in hs
            if L[r] > L[g] and a[e][r] > 0]  # fmt: skip
    deg, out = [0] * R, dict[tuple[int, int], int]()
    for e, r, g in live:
        deg[r], deg[g] = deg[r] + 1, deg[g] + 1
        out[e, r] = out.get((e, r), 0) + 1
    moves = [(e, r, g, min((L[r] - L[g]) // (max(deg[r], deg[g]) + 1), a[e][r] // out[e, r]))
             for e, r, g in live]  # fmt: skip
    for e, r, g, q in moves:
        a[e][r], a[e][g] = a[e][r] - q, a[e][g] + q


def _whole_tiles_reference(
    a: list[list[int]], hold: list[list[int]], T: list[int], bits: int
) -> list[list[int]]:
    """Whole tiles ``[E][R]`` (``T``: each expert's tiles): each holder's whole tiles,
    then each expert's left-over tiles to its holders with the largest remainders (ties:
    lower rank)."""
    R, S = len(a[0]), 1 << bits
    alloc = [[0] * R for _ in a]
    for e, hs in enumerate(hold):
        for r in hs:
            alloc[e][r] = a[e][r] // S
        short = T[e] - sum(alloc[e])
        for r in sorted(hs, key=lambda r: (-(a[e][r] % S), r))[:short]:
            alloc[e][r] += 1
    return alloc


def _rows_reference(
    tiles: list[list[int]], hold: list[list[int]], T: list[int], tile: int
) -> list[list[int]]:
    """Records ``[E][R]`` from whole tiles: by rank, each holder takes ``tile`` rows a tile
    of what its expert has left (module docstring, step 4)."""
    rows = [[0] * len(tiles[0]) for _ in tiles]
    for e, hs in enumerate(hold):
        left = T[e]
        for r in hs:
            rows[e][r] = min(tile * tiles[e][r], left)
            left -= rows[e][r]
    return rows


def resident_host(
    counts_RE: np.ndarray,
    prev_RB: np.ndarray | None,
    home_E: np.ndarray,
    tile: int = 1,
    cost: StepCost | None = None,
) -> tuple[np.ndarray, int]:
    """int64 ``[E, R]`` and the rounds run: :func:`resident_reference` in numpy over the
    list of pairs (the host path's form: its work grows with the pairs, not with
    ``E * R * R``)."""
    R, E = counts_RE.shape
    T_E = counts_RE.sum(0).astype(np.int64)
    K_E = -(-T_E // tile)
    prev = None if prev_RB is None else torch.from_numpy(np.asarray(prev_RB))
    hold_ER = holders_torch(E, R, prev, torch.from_numpy(np.asarray(home_E))).numpy()
    e_H, r_H = np.nonzero(hold_ER)  # by expert, then rank
    n_E = hold_ER.sum(1)
    idx_H = np.cumsum(hold_ER, 1)[e_H, r_H] - 1
    bits = scale_bits(int(T_E.sum()))
    units_E = K_E << bits
    a_H = units_E[e_H] // n_E[e_H] + (idx_H < (units_E % n_E)[e_H])
    i_P, j_P = np.nonzero((e_H[:, None] == e_H[None, :]) & (r_H[:, None] != r_H[None, :]))
    least, rounds = least_units(cost, tile, bits), 0
    top = _top(_sum_at(r_H, a_H, R))
    while rounds < ROUND_LIMIT:
        a_H = _round_host(a_H, r_H, (i_P, j_P), R)
        rounds += 1
        last, top = top, _top(_sum_at(r_H, a_H, R))
        if not paid(last, top, least):
            break
    a_ER = np.zeros((E, R), dtype=np.int64)
    a_ER[e_H, r_H] = a_H
    tiles_ER = _whole_tiles_torch(
        torch.from_numpy(a_ER), torch.from_numpy(hold_ER), torch.from_numpy(K_E), bits
    )
    return rows_of_tiles(tiles_ER, torch.from_numpy(T_E), tile).numpy(), rounds


def _round_host(
    a_H: np.ndarray, r_H: np.ndarray, pairs: tuple[np.ndarray, np.ndarray], R: int
) -> np.ndarray:
    """One round over the list of pairs (``a_H``: each holder's units, ``r_H`` its rank;
    ``pairs``: the holders ``(i, j)`` of each ordered pair)."""
    i_P, j_P = pairs
    L_R = _sum_at(r_H, a_H, R)
    gap_P = L_R[r_H[i_P]] - L_R[r_H[j_P]]
    live_P = (gap_P > 0) & (a_H[i_P] > 0)
    deg_R = _sum_at(r_H[i_P], live_P, R) + _sum_at(r_H[j_P], live_P, R)
    out_H = _sum_at(i_P, live_P, len(a_H))
    most_P = np.maximum(deg_R[r_H[i_P]], deg_R[r_H[j_P]]) + 1
    q_P = np.minimum(gap_P // most_P, a_H[i_P] // out_H[i_P].clip(min=1))
    q_P = np.where(live_P, q_P, 0)
    return a_H - _sum_at(i_P, q_P, len(a_H)) + _sum_at(j_P, q_P, len(a_H))


def _sum_at(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """int64 ``[size]``: ``values`` summed by ``index`` (exact integers)."""
    out = np.zeros(size, dtype=np.int64)
    np.add.at(out, index, values.astype(np.int64))
    return out


def resident_torch(
    counts_RE: torch.Tensor,
    prev_RB: torch.Tensor | None,
    home_E: torch.Tensor,
    tile: int = 1,
    cost: StepCost | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[E, R]`` and the rounds run (int64 0-d): :func:`resident_reference` on the
    counts' device, no host read: :data:`ROUND_LIMIT` rounds, each past the stop masked.

    Dense over ``[E, R]`` holders; the pairs are ``[E, R, R]`` (one ``[R, R]`` gap
    matrix shared by every expert)."""
    R, E = counts_RE.shape
    T_E = counts_RE.sum(0)
    K_E = (T_E + (tile - 1)) // tile
    hold_ER = holders_torch(E, R, prev_RB, home_E.to(counts_RE.device))
    n_E = hold_ER.sum(1)
    idx_ER = hold_ER.cumsum(1) - 1  # a holder's place among its expert's, by rank
    fine = T_E.sum() < 1 << FINE_LIMIT_BITS
    bits = torch.where(fine, SCALE_BITS, 0)  # 0-d, no host read
    units_E = K_E << bits
    a_ER = units_E[:, None] // n_E[:, None] + (idx_ER < (units_E % n_E)[:, None]).long()
    a_ER = torch.where(hold_ER, a_ER, 0)
    least = _least_torch(cost, tile, fine)
    going = torch.ones((), dtype=torch.bool, device=counts_RE.device)
    rounds = torch.zeros((), dtype=torch.int64, device=counts_RE.device)
    top = _tops(a_ER.sum(0)[None])
    for _ in range(ROUND_LIMIT):
        a_ER = torch.where(going, _round_torch(a_ER, hold_ER), a_ER)
        rounds = rounds + going.long()
        last, top = top, _tops(a_ER.sum(0)[None])
        going = going & _paid_torch(last, top, least)[0]
    return rows_of_tiles(_whole_tiles_torch(a_ER, hold_ER, K_E, bits), T_E, tile), rounds


def resident_pairs_torch(
    counts_RE: torch.Tensor, hold_ER: torch.Tensor, tile: int = 1, cost: StepCost | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[E, R]`` and the rounds run (int64 0-d): :func:`resident_host` in torch ops
    over the list of pairs, for the holders ``hold_ER`` (bool ``[E, R]``,
    :func:`holders_torch`): the one-table case of :func:`resident_tables_torch`."""
    alloc_TER, rounds_T = resident_tables_torch(counts_RE, hold_ER[None], tile, cost)
    return alloc_TER[0], rounds_T[0]


def resident_tables_torch(
    counts_RE: torch.Tensor, hold_TER: torch.Tensor, tile: int = 1, cost: StepCost | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T, E, R]`` and each table's rounds (int64 ``[T]``): :func:`resident_host`
    for each of ``T`` holder tables (bool ``[T, E, R]``), of one step's counts (int64
    ``[R, E]``) or of each table's own (``[T, R, E]``), in torch ops over the list of
    pairs, all tables' rounds at once, each table's stopping on its own (table ``t``'s
    rank ``r`` is load ``t * R + r``: no pair joins two tables). Its work grows with the
    pairs, not with ``E * R * R``; the pairs are read once from ``hold_TER`` and whether a
    table still runs once a round (host reads where they live on a device), so with a
    table per step it builds any set of (step, table) entries in one call
    (``moonplan.plan.residency.window_torch``)."""
    T, E, R = hold_TER.shape
    dev = hold_TER.device
    T_TE = counts_RE.sum(-2).expand(T, E)
    K_TE = (T_TE + (tile - 1)) // tile
    t_H, e_H, r_H = hold_TER.nonzero(as_tuple=True)  # by table, expert, then rank
    n_H = hold_TER.sum(2)[t_H, e_H]
    idx_H = (hold_TER.cumsum(2) - 1)[t_H, e_H, r_H]
    fine_T = T_TE.sum(1) < 1 << FINE_LIMIT_BITS
    bits_T = torch.where(fine_T, SCALE_BITS, 0)
    units_H = K_TE[t_H, e_H] << bits_T[t_H]
    a_H = units_H // n_H + (idx_H < units_H % n_H).long()
    x_H = t_H * R + r_H  # load across the tables
    least_T = _least_torch(cost, tile, fine_T)
    a_H, rounds_T = _table_rounds(a_H, x_H, _pairs(n_H, idx_H, R), (T, R), least_T)
    a_TER = torch.zeros(T, E, R, dtype=torch.int64, device=dev).index_put((t_H, e_H, r_H), a_H)
    bits_X1 = bits_T.repeat_interleave(E)[:, None]
    X = T * E
    tiles_XR = _whole_tiles_torch(
        a_TER.reshape(X, R), hold_TER.reshape(X, R), K_TE.reshape(X), bits_X1
    )
    return rows_of_tiles(tiles_XR, T_TE.reshape(X), tile).reshape(T, E, R), rounds_T


def _table_rounds(
    a_H: torch.Tensor,
    x_H: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, int],
    least_T: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each holder's units after its table's rounds, and each table's rounds (``x_H``: the
    holder's load across the tables; ``pairs``: the holders ``(i, j)`` of each ordered
    pair; ``shape``: ``(T, R)``; ``least_T``: :func:`least_units` of each table)."""
    T, R = shape
    i_P, j_P = pairs
    xi_P, xj_P, H = x_H[i_P], x_H[j_P], len(a_H)
    zeros_X = torch.zeros(T * R, dtype=torch.int64, device=a_H.device)
    zeros_H = torch.zeros(H, dtype=torch.int64, device=a_H.device)
    going_T = torch.ones(T, dtype=torch.bool, device=a_H.device)
    rounds_T = torch.zeros(T, dtype=torch.int64, device=a_H.device)
    top_T = _tops(zeros_X.index_add(0, x_H, a_H).view(T, R))
    going_P = going_T[xi_P // R]
    for _ in range(ROUND_LIMIT):
        L_X = zeros_X.index_add(0, x_H, a_H)
        gap_P = L_X[xi_P] - L_X[xj_P]
        live_P = ((gap_P > 0) & (a_H[i_P] > 0)).long()
        deg_X = zeros_X.index_add(0, xi_P, live_P) + zeros_X.index_add(0, xj_P, live_P)
        out_H = zeros_H.index_add(0, i_P, live_P)
        most_P = torch.maximum(deg_X[xi_P], deg_X[xj_P]) + 1
        q_P = torch.minimum(gap_P // most_P, a_H[i_P] // out_H[i_P].clamp(min=1))
        q_P = torch.where((live_P > 0) & going_P, q_P, 0)
        a_H = a_H - zeros_H.index_add(0, i_P, q_P) + zeros_H.index_add(0, j_P, q_P)
        rounds_T = rounds_T + going_T.long()
        last_T, top_T = top_T, _tops(zeros_X.index_add(0, x_H, a_H).view(T, R))
        going_T = going_T & _paid_torch(last_T, top_T, least_T)
        if not bool(going_T.any()):
            break
        going_P = going_T[xi_P // R]
    return a_H, rounds_T


def _least_torch(cost: StepCost | None, tile: int, fine: torch.Tensor) -> torch.Tensor:
    """int64, ``fine``'s shape: :func:`least_units` at :data:`SCALE_BITS` where ``fine``
    (bool: fewer than ``2**FINE_LIMIT_BITS`` records), else at 0 bits; no host read."""
    return torch.where(fine, least_units(cost, tile, SCALE_BITS), least_units(cost, tile, 0))


def _tops(L_TR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` each: the largest of each row of loads ``L_TR`` and how many ranks
    hold it."""
    top_T = L_TR.amax(1)
    return top_T, (L_TR == top_T[:, None]).sum(1)


def _paid_torch(
    last: tuple[torch.Tensor, torch.Tensor],
    now: tuple[torch.Tensor, torch.Tensor],
    least_T: torch.Tensor | int,
) -> torch.Tensor:
    """bool ``[T]``: :func:`paid` of each table (``last``, ``now``: :func:`_tops`)."""
    drop_T = last[0] - now[0]
    fell_T = (drop_T >= least_T) | ((drop_T == 0) & (now[1] < last[1]))
    return fell_T & (torch.as_tensor(least_T, device=drop_T.device) < NEVER)


def _pairs(n_H: torch.Tensor, idx_H: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[P]`` pair: every ordered pair ``(i, j)`` of two holders of one expert of one
    table, ``i != j``, by ``i`` then ``j`` (holders listed by table, expert, then rank:
    ``n_H`` holders in each one's group, ``idx_H`` its place there)."""
    first_H = torch.arange(len(n_H), device=n_H.device) - idx_H
    k_K = torch.arange(R, device=n_H.device)
    ok_HK = (k_K[None, :] < n_H[:, None]) & (k_K[None, :] != idx_H[:, None])
    i_P, k_P = ok_HK.nonzero(as_tuple=True)
    return i_P, first_H[i_P] + k_P


def rows_of_tiles(tiles_ER: torch.Tensor, T_E: torch.Tensor, tile: int) -> torch.Tensor:
    """int64 ``[E, R]`` records from whole tiles ``tiles_ER`` (:func:`_rows_reference`):
    a holder's rows are ``T[e]`` less ``tile`` rows for each tile of a lower-ranked holder,
    between 0 and ``tile`` times its own tiles."""
    before_ER = tiles_ER.cumsum(1) - tiles_ER
    left_ER = (T_E[:, None] - tile * before_ER).clamp(min=0)
    return torch.minimum(left_ER, tile * tiles_ER)


def holders_torch(
    E: int, R: int, prev_RB: torch.Tensor | None, home_E: torch.Tensor
) -> torch.Tensor:
    """bool ``[E, R]``: ``(e, r)`` is a holder (home, or in one of ``r``'s first ``M``
    previous slots)."""
    dev = home_E.device
    hold_ER = torch.zeros(E, R, dtype=torch.bool, device=dev)
    hold_ER[torch.arange(E, device=dev), home_E] = True
    if prev_RB is None or prev_RB.shape[1] == 0:
        return hold_ER
    M = -(-E // R)
    slots_RB = prev_RB[:, :M]
    ok_RB = (slots_RB >= 0) & (slots_RB < E)
    r_RB = torch.arange(R, device=dev)[:, None].expand_as(slots_RB)
    hold_ER[slots_RB[ok_RB], r_RB[ok_RB]] = True
    return hold_ER


def _round_torch(a_ER: torch.Tensor, hold_ER: torch.Tensor) -> torch.Tensor:
    """One round: ``a_ER`` after every live pair's move (module docstring)."""
    L_R = a_ER.sum(0)
    gap_RG = L_R[:, None] - L_R[None, :]
    live_ERG = (hold_ER & (a_ER > 0))[:, :, None] & hold_ER[:, None, :] & (gap_RG > 0)[None]
    one = live_ERG.long()
    deg_R = one.sum((0, 2)) + one.sum((0, 1))
    out_ER = one.sum(2)
    share_RG = gap_RG // (torch.maximum(deg_R[:, None], deg_R[None, :]) + 1)
    cap_ER = a_ER // out_ER.clamp(min=1)
    q_ERG = torch.where(live_ERG, torch.minimum(share_RG[None], cap_ER[:, :, None]), 0)
    return a_ER - q_ERG.sum(2) + q_ERG.sum(1)


def _whole_tiles_torch(
    a_ER: torch.Tensor, hold_ER: torch.Tensor, T_E: torch.Tensor, bits: int | torch.Tensor
) -> torch.Tensor:
    """int64 ``[E, R]`` whole tiles (:func:`_whole_tiles_reference`; ``T_E``: each
    expert's tiles); ``bits``: of a unit below one tile (an int, or an int64 tensor on the
    device, 0-d or ``[E, 1]``: each expert's)."""
    S = torch.ones((), dtype=torch.int64, device=a_ER.device) << bits
    whole_ER, rem_ER = a_ER >> bits, a_ER & (S - 1)
    short_E = T_E - whole_ER.sum(1)
    R = a_ER.shape[1]
    r_R = torch.arange(R, device=a_ER.device)
    key_ER = torch.where(hold_ER, (S - 1 - rem_ER) * R + r_R[None, :], S * R)  # ascending
    order_ER = key_ER.argsort(1)
    place_ER = order_ER.argsort(1)  # each holder's place in the order (the inverse)
    return whole_ER + (hold_ER & (place_ER < short_E[:, None])).long()
