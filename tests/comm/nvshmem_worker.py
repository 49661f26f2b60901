"""One rank of the GPU check of the nvshmem heap (started by ``test_nvshmem_heap``).

Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Prints ``OK``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moonplan.comm import EPGroup, create_heap


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = EPGroup()
    heap = create_heap(group, 1 << 20)  # auto: nvshmem on CUDA
    assert heap.backend == "nvshmem", heap.backend
    R, rank = group.size, group.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        sym = heap.alloc((R, 4), dtype)
        assert sym.local.device == group.device and sym.offset % 256 == 0
        for peer in range(R):
            sym.peer(peer)[rank] = torch.full((4,), rank + 10 * peer, device=group.device).to(dtype)
        heap.barrier()
        want = torch.tensor([[r + 10 * rank] * 4 for r in range(R)], device=group.device)
        assert torch.equal(sym.local.to(torch.int64), want), (dtype, sym.local)
        heap.barrier()
    heap.check_consistent()
    heap.close()
    dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
