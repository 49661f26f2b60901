"""Row operations of the runtime, each as a torch reference and a Triton kernel.

Legend: none (see each module).

Moving rows between ranks' buffers by ``(rank, row)`` addresses: ``torch`` (readable
twins), ``triton`` (peer-pointer kernels, bit-identical) and ``backend.row_ops_for(device)``,
which picks one of them for a device. Expanding token rows into expert-grouped rows and
reducing them back (token-once dispatch and combine): ``token_torch`` and ``token_triton``.
"""

from moonplan.runtime.row_ops.backend import row_ops_for, token_ops_for

__all__ = ["row_ops_for", "token_ops_for"]
