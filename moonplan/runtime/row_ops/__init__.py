"""Row movement between ranks' buffers by ``(rank, row)`` addresses.

Legend: none (see each module).

``torch`` (readable twins), ``triton`` (peer-pointer kernels, bit-identical) and
``backend.row_ops_for(device)``, which picks one of them for a device.
"""

from moonplan.runtime.row_ops.backend import row_ops_for

__all__ = ["row_ops_for"]
