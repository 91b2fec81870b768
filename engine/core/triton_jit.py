"""`triton.jit` options that differ between Triton releases, kept in one place for the kernels."""

from __future__ import annotations

import inspect


def jit_options(**options) -> dict:
    """The subset of `options` that this Triton's `triton.jit` takes (releases before 3.2 lack
    `do_not_specialize_on_alignment`: there the kernel keeps Triton's default specialization)."""
    import triton

    accepted = inspect.signature(triton.jit).parameters
    return {name: value for name, value in options.items() if name in accepted}
