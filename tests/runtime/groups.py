"""Random group sizes for the grouped-GEMM tests (``test_grouped_gemm``, ``test_experts``).

Legend: G groups; ``sizes_G`` int64 rows of each group, many of them empty.
"""

from __future__ import annotations

import torch


def random_group_sizes(
    gen: torch.Generator, max_groups: int, max_rows: int, empty_share: float
) -> torch.Tensor:
    """int64 ``sizes_G``: ``G`` uniform in ``[1, max_groups]``, each size uniform in
    ``[0, max_rows]``, then each group emptied with probability ``empty_share`` (long
    runs of empty groups are the adversarial case of a grouped GEMM's tile schedule)."""
    G = int(torch.randint(1, max_groups + 1, (1,), generator=gen))
    sizes_G = torch.randint(0, max_rows + 1, (G,), generator=gen)
    sizes_G[torch.rand(G, generator=gen) < empty_share] = 0
    return sizes_G
