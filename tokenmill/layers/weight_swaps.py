"""A process-wide count of the assignments that may replace a module's weights: a parameter
or buffer registered or re-assigned on any module (torch's global registration hooks), and
a ``Linear``'s ``packed`` / ``prepacked`` entries (layers/linear.py). Code that keeps raw
addresses of weights (the C decode stack's plan, runner/fused_plan.py) rescans its modules
only when the count moved since its last scan: the scan touches a few hundred objects,
each a cache miss after a decode step's weights have streamed through the caches.

Not counted: in-place changes that keep the objects (``param.data = t``, ``copy_``), which
the address pins never saw either, and writes straight into a module's ``_parameters`` /
``__dict__``, which bypass torch's hooks."""
from __future__ import annotations

from torch.nn.modules import module as torch_module

_count = 0


def count() -> int:
    return _count


def bump(*_args) -> None:
    """Note an assignment (the hooks' signature: module, name, value; returns None, so the
    assigned value is kept)."""
    global _count
    _count += 1


torch_module.register_module_parameter_registration_hook(bump)
torch_module.register_module_buffer_registration_hook(bump)
