"""Multi-tensor (``foreach``) optimizer steps run per chunk of parameters while capuchin traces or
runs a script (Note [Multi-tensor optimizers per chunk])."""

from __future__ import annotations

import functools
import importlib
import sys

import torch

from .hooks import SPLIT_GROUP_BYTES, group_bounds

# Note: [Multi-tensor optimizers per chunk]
# A ``foreach`` optimizer step (``torch.optim.adam._multi_tensor_adam``, which AdamW uses too)
# sweeps its whole state list several times: ``_foreach_lerp_(exp_avgs, grads)``, then
# ``_foreach_mul_/_addcmul_(exp_avg_sqs, ...)``, ``_foreach_sqrt``, ...,
# ``_foreach_addcdiv_(params, exp_avgs, ...)``. The op split (Note [Multi-tensor op split] in
# hooks.py) runs each sweep in groups, but every state tensor is still read in several sweeps
# separated by sweeps over all the other parameters, and a plan has one decision per storage (plus
# a dead one), so the state cannot stay out between sweeps, and the smallest feasible budget of
# the foreach form stays far above the per-tensor loop's (docs/persistent-state.md has figures).
#
# So while the tracer or the runtime is entered (both, identically: a plan matches the trace op
# by op), the module attributes ``torch.optim.<module>._multi_tensor_<name>`` named in
# ``CHUNKED`` are replaced by a wrapper that calls the original on consecutive chunks of its
# list arguments: each chunk's state is read in one contiguous burst, as in the loop form (the
# fused form behaves so already: one kernel per group). The chunks follow the op split's byte
# rule (``group_bounds``, ``SPLIT_GROUP_BYTES``) over the bytes of all of an element's tensors in
# all the list arguments, so every op a chunk runs fits in one split group and is not split
# again; an element larger than that is a chunk of its own. Scalars, ``lr`` as a tensor,
# ``grad_scale``, ``found_inf`` and keyword arguments go to every chunk unchanged; an empty list
# (``max_exp_avg_sqs`` without amsgrad) goes to every chunk as it is; list elements a chunk
# assigns (SGD's first momentum buffers) are written back into the caller's list.
#
# Exactness: the functionals group by device and dtype and then compute each element from that
# element's tensors and the shared scalars alone, so a chunk computes for its elements what the
# whole call does (the same kernels on sub-lists; tests/test_optimizer_chunks.py compares, per
# functional and option, params and every state tensor with torch.equal against the unpatched
# functional). Where the path an element takes depends on the other elements, the call runs
# whole: SGD and Adagrad with a sparse gradient (``has_sparse_grad``: the per-tensor path for
# the whole device group), SGD with some momentum buffers present and some not (the foreach
# path only when all are present), lists of unequal lengths. ``_multi_tensor_adafactor`` is not
# patched (its branch for factored state is chosen by the first element of a group).
#
# ``adam()``, ``sgd()``, ... look the functional up in their module's globals at each call, so
# replacing the attribute is enough; the optimizer's ``step`` and its hooks are untouched (they
# fire once per step as before). A functional a torch version lacks is skipped: that optimizer
# runs unchunked in the tracer and the runtime alike. The originals are restored on exit; a
# nested entry (the tracer under a budget enters a runtime) leaves the outer patch in place.


def _no_sparse(args: tuple, kwargs: dict) -> bool:
    return not kwargs.get("has_sparse_grad", False)


def _sgd_exact(args: tuple, kwargs: dict) -> bool:
    """SGD runs its foreach momentum path only when every element of a device group has a
    buffer, else its per-element path: exact per chunk when all or none have one."""
    if not _no_sparse(args, kwargs):
        return False
    bufs = args[2] if len(args) > 2 else kwargs.get("momentum_buffer_list", [])
    missing = sum(b is None for b in bufs)
    return missing in (0, len(bufs))


def _always(args: tuple, kwargs: dict) -> bool:
    return True


# (module under torch.optim, functional name, when a call may run per chunk)
CHUNKED = (
    ("adam", "_multi_tensor_adam", _always),  # Adam and AdamW
    ("adamax", "_multi_tensor_adamax", _always),
    ("nadam", "_multi_tensor_nadam", _always),
    ("radam", "_multi_tensor_radam", _always),
    ("rmsprop", "_multi_tensor_rmsprop", _always),
    ("adadelta", "_multi_tensor_adadelta", _always),
    ("asgd", "_multi_tensor_asgd", _always),
    ("rprop", "_multi_tensor_rprop", _always),
    ("adagrad", "_multi_tensor_adagrad", _no_sparse),
    ("sgd", "_multi_tensor_sgd", _sgd_exact),
)


def chunk_bounds(args: tuple, kwargs: dict, cap: int = SPLIT_GROUP_BYTES):
    """The chunks ``[(lo, hi), ...]`` of a multi-tensor functional's call, or None to run it
    whole (one chunk, no list, lists of unequal lengths)."""
    n = -1
    lists = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            if len(v) == 0:
                continue
            if n < 0:
                n = len(v)
            elif len(v) != n:
                return None
            lists.append(v)
    if n <= 1:
        return None
    sizes = [0] * n
    for v in lists:
        for i, t in enumerate(v):
            if isinstance(t, torch.Tensor):
                sizes[i] += t.numel() * t.element_size()
    bounds = group_bounds(sizes, cap)
    return bounds if len(bounds) > 1 else None


def _part(v, lo: int, hi: int):
    return v[lo:hi] if isinstance(v, (list, tuple)) and len(v) > 0 else v


def chunked(original, exact=_always, cap: int = SPLIT_GROUP_BYTES):
    """``original`` called on consecutive chunks of its list arguments (Note [Multi-tensor
    optimizers per chunk])."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bounds = chunk_bounds(args, kwargs, cap) if exact(args, kwargs) else None
        if bounds is None:
            return original(*args, **kwargs)
        for lo, hi in bounds:
            a = [_part(v, lo, hi) for v in args]
            kw = {k: _part(v, lo, hi) for k, v in kwargs.items()}
            original(*a, **kw)
            # elements the chunk assigned (SGD's first momentum buffers) back into the caller's
            for whole, part in zip((*args, *kwargs.values()), (*a, *kw.values()), strict=True):
                if isinstance(whole, list) and part is not whole:
                    whole[lo:hi] = part
        return None

    wrapper.__capuchin_chunked__ = original
    return wrapper


class ChunkedOptimizers:
    """While entered, the ``CHUNKED`` functionals present in this torch run per chunk (Note
    [Multi-tensor optimizers per chunk]). Re-entrant per object: ``__exit__`` restores what
    this object's ``__enter__`` replaced."""

    def __init__(self, cap: int = SPLIT_GROUP_BYTES):
        self.cap = cap
        self._replaced: list = []

    def __enter__(self) -> ChunkedOptimizers:
        for mod_name, name, exact in CHUNKED:
            try:
                mod = importlib.import_module(f"torch.optim.{mod_name}")
            except ImportError:
                continue
            original = getattr(mod, name, None)
            if original is None or hasattr(original, "__capuchin_chunked__"):
                continue  # absent in this torch, or patched by an outer entry
            setattr(mod, name, chunked(original, exact, self.cap))
            self._replaced.append((mod, name, original))
        return self

    def __exit__(self, *exc) -> None:
        while self._replaced:
            mod, name, original = self._replaced.pop()
            setattr(mod, name, original)


def patched() -> list[str]:
    """The functionals now running per chunk (``module.name``)."""
    out = []
    for mod_name, name, _ in CHUNKED:
        mod = sys.modules.get(f"torch.optim.{mod_name}")
        if hasattr(getattr(mod, name, None), "__capuchin_chunked__"):
            out.append(f"{mod_name}.{name}")
    return out
