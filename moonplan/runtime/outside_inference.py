"""``outside_inference``: a layer's own state is never made in inference mode.

A layer keeps tensors across its steps: plans (``resident``, ``last_plan``, the
balancer's last), load windows, the placer's decisions, buffers rebuilt larger (heap,
receive and output rows, expert store, reducer) and refill staging rows. A tensor made
under ``torch.inference_mode()`` is an *inference tensor*: outside inference mode it can
neither be written in place ("Inplace update to inference tensor outside InferenceMode")
nor be saved for backward ("Inference tensors cannot be saved for backward"). One step
under ``inference_mode`` would then break every later step under ``no_grad`` or with
autograd on.

The runtime's entry points (construction, the step, the calls between steps) run their
bodies inside :func:`outside_inference`, so whatever they keep is a normal tensor
whatever mode the caller is in. Only inference mode is left: grad mode stays the
caller's (``torch.inference_mode(False)`` alone would turn it on), so a step under
``inference_mode`` or ``no_grad`` still records no graph. Values are unchanged: a mode
decides what autograd tracks, never what is computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def outside_inference() -> Iterator[None]:
    """Run the body outside inference mode, in the caller's grad mode.

    Tensors made in the body are normal tensors (``is_inference()`` false); the caller's
    inference tensors (inputs made under ``inference_mode``) can still be read there.
    Also a decorator (``@outside_inference()``). Costs two thread-local mode switches.
    """
    grad = torch.is_grad_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        yield
