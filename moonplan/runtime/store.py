"""Expert weights of one layer: home rows, then ``B`` prefetch slots, per projection.

Legend:
    R ranks, E experts, M = ceil(E/R) home rows, B slots, D direct replicas,
    N new slots, C = N + D rows one rank copies in a step, S refill staging rows,
    J slots one refill changes on this rank (``J <= S``),
    F expert FFN size, H hidden; projections ``gate_up [rows, 2F, H]`` and
    ``down [rows, H, F]`` (transformers layout, gate rows first)

Every rank holds the same ``[M + B]`` rows per projection, in buffers of its
transport (``Transport.alloc_shared``): its home experts (padded to ``M``) then its
slots. ``prefetch(fetch_list)`` fills the slots the plan marks new (``slot_new``) and
reads the direct replicas (beyond ``B``), both from the home ranks' rows
(``Transport.fetch_rows``), as listed by :mod:`moonplan.runtime.fetch_list`;
residents stay. Peer loads on a heap, all-to-alls elsewhere: the transport decides.
Weight rows are fetched through ``ExpertStore.fetcher``: the transport, or its view
on the layer's background process group (:meth:`ExpertStore.fetch_on`) where a
worker thread runs the all-to-all prefetch and reduce beside the data path.

Beside them, ``S`` local staging rows per projection (no peer reads them; every layer of
these shapes on the device shares them: :mod:`moonplan.runtime.staging`) take a
background refill's copies (:meth:`ExpertStore.stage`) until every rank has its own and
they are copied into the slots between two steps (:meth:`ExpertStore.commit`;
:mod:`moonplan.runtime.refill`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan.home import home_start, max_local
from moonplan.plan.plan_type import Plan
from moonplan.runtime.fetch_list import FetchList, HomeRows
from moonplan.runtime.staging import shared_pool
from moonplan.runtime.transports.base import SharedRows, Transport

PROJECTIONS = ("gate_up", "down")


class ExpertStore:
    """Symmetric (or local) weight rows for every projection of one MoE layer."""

    def __init__(
        self,
        transport: Transport,
        *,
        num_experts: int,
        num_slots: int,
        hidden: int,
        ffn: int,
        dtype: torch.dtype,
        num_staging: int = 0,
    ):
        self.transport, self.group = transport, transport.group
        self.fetcher: Transport = transport  # what fetch_rows goes through
        self.E, self.B = num_experts, num_slots
        self.M = max_local(num_experts, self.group.size)
        shapes = {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
        rows_ = self.M + num_slots
        self.shared = {n: transport.alloc_shared((rows_, *sh), dtype) for n, sh in shapes.items()}
        self.local = {name: buf.local for name, buf in self.shared.items()}
        device = self.local[PROJECTIONS[0]].device
        # [S, ...] per projection: a refill's rows until its commit, shared by every layer
        # of these shapes on the device (moonplan.runtime.staging)
        self.pool = shared_pool(device, dtype, hidden, ffn, num_staging)
        self.home = HomeRows.of(num_experts, self.group.size)  # where each expert's rows are
        self.valid = False  # home rows published and slots consistent with `resident`

    def fetch_on(self, group: EPGroup) -> None:
        """Fetch weight rows (:meth:`prefetch`, :meth:`GradReducer.collect`) through
        ``group``'s collectives (``Transport.on_group``): the layer's background group,
        same ranks; the data path keeps the transport's own group. The store's own group
        fetches through the transport itself again."""
        if group is self.group:
            self.fetcher = self.transport
            return
        view = self.transport.on_group(group)
        if view is None:
            raise ValueError(
                f"transport {self.transport.name!r} cannot fetch on another process group "
                "(its on_group returns None)"
            )
        self.fetcher = view

    def publish_home(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's home experts (``[E_r, ...]`` per projection) into the home rows.

        Collective: every rank calls it; afterwards every slot is stale.
        """
        for name in PROJECTIONS:
            w = weights[name].detach()
            self.local[name][: w.shape[0]].copy_(w)
        self.transport.publish()
        self.valid = True

    def prefetch(self, fetch: FetchList) -> tuple[int, dict[str, torch.Tensor]]:
        """Fill this rank's new slots and read its direct rows, from the home ranks.

        One ``fetch_rows`` per projection brings the new slots' rows and then the direct
        rows (``C`` rows). Collective unless the transport is ``one_sided``
        (heap: peer loads). Slots not in ``fetch`` keep their weights (residents of
        ``previous=``).

        Returns:
            The number of slots filled (``N``), and the direct rows' weights
            (``[D, ...]`` per projection, in row order).
        """
        slot_N, rank_C, row_C = fetch.index(self.local[PROJECTIONS[0]].device)
        N = slot_N.numel()
        direct = {}
        for name in PROJECTIONS:
            got = self.fetcher.fetch_rows(self.shared[name], rank_C, row_C)
            self.local[name][self.M + slot_N] = got[:N]
            direct[name] = got[N:]
        return N, direct

    def stage(self, fetch: FetchList) -> int:
        """Copy a refill's rows into the staging rows, from the home ranks: ``fetch.slot_N``
        (``J`` slots, ``J <= S``) in order, through the same ``fetch_rows`` as
        :meth:`prefetch` (collective unless ``one_sided``); no slot row is written.

        Returns:
            ``J``, the rows staged.
        """
        slot_J, rank_J, row_J = fetch.index(self.local[PROJECTIONS[0]].device)
        J, S = slot_J.numel(), self.pool.size
        if J > S:
            raise ValueError(f"{J} refill rows do not fit the {S} staging rows")
        got = {n: self.fetcher.fetch_rows(self.shared[n], rank_J, row_J) for n in PROJECTIONS}
        for name in PROJECTIONS:  # after every collective: a failure here strands no peer
            self._put_staged(name, got[name])
        return J

    def _put_staged(self, name: str, rows: torch.Tensor) -> None:
        """Write ``rows [J, ...]`` of projection ``name`` into its first staging rows."""
        self.pool.rows[name][: rows.shape[0]].copy_(rows)

    def commit(self, slot_J: tuple[int, ...]) -> None:
        """Copy the staged rows into slots ``slot_J`` (local; between two steps only, when
        no step reads the slots: :mod:`moonplan.runtime.refill`)."""
        if not slot_J:
            return
        index = torch.tensor(slot_J, dtype=torch.int64, device=self.local["down"].device)
        for name in PROJECTIONS:
            self.local[name][self.M + index] = self.pool.rows[name][: len(slot_J)]

    def no_fetch(self) -> tuple[int, dict[str, torch.Tensor]]:
        """What :meth:`prefetch` returns when nothing is copied: no slot, no direct row."""
        return 0, {name: w[:0] for name, w in self.local.items()}

    def slots(self, name: str) -> torch.Tensor:
        """``[B, ...]`` this rank's slot rows of a projection."""
        return self.local[name][self.M :]


class GradReducer:
    """Sends replica-row gradients to their home rank, which adds them exactly once.

    Legend: ``X = B + D`` remote rows per rank (slots, then direct rows).

    Every rank writes the gradients of its remote rows (``[X, ...]`` per projection)
    into its own reduce buffer; each home rank then reads, from every peer in
    ascending rank order, the rows that hold its experts and adds them to its own
    gradient in that fixed order (bit-identical run to run).
    """

    def __init__(self, store: ExpertStore, num_remote_rows: int):
        self.store, self.X, self.transport = store, num_remote_rows, store.transport
        self.shared: dict[str, SharedRows] = {
            name: self.transport.alloc_shared((num_remote_rows, *w.shape[1:]), w.dtype)
            for name, w in store.local.items()
        }
        self.local = {name: buf.local for name, buf in self.shared.items()}

    def reduce(
        self, plan: Plan, remote: dict[str, torch.Tensor], num_home: int
    ) -> dict[str, torch.Tensor]:
        """Gradients of this rank's home experts from every peer's replicas (``[E_r, ...]``).

        Collective. ``remote[name]`` holds this rank's remote-row gradients: its ``B``
        slots, then its direct rows (as many as it uses, at most ``X - B``). The same as
        :meth:`stage`, a barrier, :meth:`collect`, a barrier (the overlapped backward
        runs those steps itself, with :meth:`collect` in the background).
        """
        self.stage(remote)
        self.transport.publish()  # every rank's gradients are in its reduce buffer
        out = self.collect(plan, num_home)
        self.transport.publish()  # nobody overwrites a reduce buffer still being read
        return out

    def stage(self, remote: dict[str, torch.Tensor]) -> None:
        """Write this rank's remote-row gradients into its reduce buffer (local)."""
        for name in PROJECTIONS:  # slots, then the direct rows actually used (rest unused)
            n = remote[name].shape[0]
            self.local[name][:n].copy_(remote[name])

    def collect(self, plan: Plan, num_home: int) -> dict[str, torch.Tensor]:
        """fp32 sums ``[E_r, ...]`` of the staged rows that hold this rank's experts.

        On a ``one_sided`` transport (heap): peer reads only (call it between two
        ``publish`` calls that follow every rank's :meth:`stage`), so it may run in a
        background thread. Otherwise a collective, on the store's ``fetcher`` group (the
        background group when the runtime runs it in a worker thread).
        """
        group, M = self.store.group, self.store.M
        r = group.rank
        e_RX = plan.row_expert[:, M:]
        live_RX = (plan.row_count[:, M:] > 0) & (plan.home[e_RX.clamp(min=0)] == r)
        q_N, j_N = live_RX.nonzero(as_tuple=True)  # ascending peer, then row
        first = home_start(r, self.store.E, group.size)
        slot_N = e_RX[q_N, j_N] - first
        out = {}
        for name in PROJECTIONS:
            got = self.store.fetcher.fetch_rows(self.shared[name], q_N, j_N)
            acc = torch.zeros(num_home, *got.shape[1:], dtype=torch.float32, device=got.device)
            for q in range(group.size):  # fixed order: ascending source rank
                sel = q_N == q
                acc.index_add_(0, slot_N[sel], got[sel].float())
            out[name] = acc
        return out
