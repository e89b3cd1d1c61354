"""Which device a run manages, and what its budget means on CUDA: the memory cap, the memory the
budget does not count, the allocator's cheap counter, the determinism precondition.

# Note: [Budget and the allocator]
# A budget (a plan's, ``--budget``) counts the bytes of tensor storages, as the trace and the
# planner do. On CUDA the caching allocator holds more than that: every request is rounded (512 B
# below 1 MiB; large blocks keep unsplit remainders), memory is reserved in segments (2 MiB for
# requests of at most 1 MiB, 20 MiB for 1-10 MiB, above that rounded to 2 MiB), and cuBLAS keeps a
# workspace per (thread, stream) allocated through the same allocator (32 MiB on sm90 by
# default; the main thread and the autograd engine's device thread each get one). No trace row
# is such memory. ``set_per_process_memory_fraction`` limits what the allocator *reserves*, so
# a cap set to the budget made every small budget fail in iteration 0. Hence:
# - the tracer measures the non-tensor memory of the traced iterations (allocated at an
#   iteration's start minus the resident storages it records) into the trace's
#   ``extra["cuda_non_tensor_bytes"]``; the planner copies it into the plan's provenance
#   (``device_non_tensor_bytes``);
# - the runtime's cap is ``budget + non-tensor + headroom`` (``cap_bytes``): the non-tensor part
#   is the larger of the plan's measurement and the cuBLAS workspaces this process will make
#   (``cublas_workspace_bytes`` x ``WORKSPACE_THREADS``), the headroom one large segment plus an
#   eighth of the budget for rounding and fragmentation. The cap is the allocator's last line
#   (an out-of-memory error there makes passive mode evict and retry); the budget guard keeps
#   tensor bytes within the budget, counting ``memory_allocated`` minus the same non-tensor
#   bytes (never below the storages it counts), and a run's measured peaks subtract them too
#   (Note [Measured peak] in report.py). The workspaces are made at the run's start
#   (``warm_cublas``), so the subtraction holds from the first op, in dynamic mode too (no plan,
#   no measurement: the workspaces alone).
# ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` makes reserved memory follow allocated
# memory closely (segments grow in place): recommended under tight budgets (docs/runtime.md).
"""

from __future__ import annotations

import os

import torch

from ..errors import PlanFormatError

MIB = 1 << 20
SMALL_REQUEST_MAX = MIB  # requests up to this size come from the small pool
SMALL_ROUND = 512  # every request is rounded up to a multiple of this
SMALL_SEGMENT = 2 * MIB  # a segment of the small pool
LARGE_SEGMENT = 20 * MIB  # the segment for requests of 1-10 MiB
LARGE_ROUND = 2 * MIB  # requests above 10 MiB get a segment rounded up to this
MEDIUM_REQUEST_MAX = 10 * MIB
WORKSPACE_THREADS = 2  # cuBLAS handles are per thread: the script's and autograd's device thread
HEADROOM_FRACTION = 8  # the cap's headroom: budget / 8 (rounding, unsplit remainders) ...
HEADROOM_BYTES = LARGE_SEGMENT  # ... plus one 20 MiB segment


def segment_bytes(nbytes: int) -> int:
    """The segment the caching allocator reserves (cudaMalloc) for a request of ``nbytes``
    when no cached block fits (c10/cuda/CUDACachingAllocator.cpp ``get_allocation_size``)."""
    if nbytes <= SMALL_REQUEST_MAX:
        return SMALL_SEGMENT
    if nbytes < MEDIUM_REQUEST_MAX:
        return LARGE_SEGMENT
    return -(-nbytes // LARGE_ROUND) * LARGE_ROUND


def block_bytes(nbytes: int) -> int:
    """The block size the allocator counts in ``memory_allocated`` (``round_size``)."""
    if nbytes < SMALL_ROUND:
        return SMALL_ROUND
    return -(-nbytes // SMALL_ROUND) * SMALL_ROUND


def cublas_workspace_bytes(config: str | None = None, major: int | None = None) -> int:
    """One cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs) when set,
    else PyTorch's default for the device generation (``major``: compute capability; sm90 and
    later 32 MiB, earlier ``:4096:2:16:8``)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if config:
        parts = [p for p in config.split(":") if p]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if nums and len(nums) % 2 == 0:
            return sum(nums[i] * 1024 * nums[i + 1] for i in range(0, len(nums), 2))
    if major is not None and major >= 9:
        return 32 * MIB
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def non_tensor_bytes(measured: int | None, workspace: int, made: int = 0) -> int:
    """The device memory a budget does not count (Note [Budget and the allocator]): the largest
    of what the trace measured, the workspaces this process makes by the formula, and what
    ``warm_cublas`` measured it made (``made``)."""
    return max(int(measured or 0), WORKSPACE_THREADS * int(workspace), int(made))


def warm_cublas(device: torch.device) -> int:
    """Make the cuBLAS workspaces of the calling thread and of autograd's device thread now (a
    tiny product with a bias, cuBLASLt's path, and its backward), so that the non-tensor bytes a
    run subtracts from the allocator's count are allocated before its first op rather than in the
    middle of its first iteration. Returns the bytes this made (0 where the script's products
    made them already). No random number is drawn; nothing stays but the workspaces, which the
    script's first products would have made (on an H200 with torch 2.11: two of 32 MiB and one
    of 1 MiB)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        before = torch.cuda.memory_allocated(device)
        try:
            a = torch.zeros(8, 8, device=device, requires_grad=True)
            bias = torch.zeros(8, device=device)
            torch.nn.functional.linear(a, a, bias).sum().backward()
            del a, bias
        except RuntimeError:  # entered under inference_mode: the formula's workspaces stand
            return 0
        return max(0, torch.cuda.memory_allocated(device) - before)


def run_non_tensor_bytes(device: torch.device, measured: int | None = 0) -> int:
    """What a run on ``device`` subtracts from the allocator's count (Note [Budget and the
    allocator]): the workspaces made now (``warm_cublas``), then the largest of ``measured``
    (the plan's trace), the formula's workspaces and what was made."""
    made = warm_cublas(device)
    major = torch.cuda.get_device_properties(device).major
    return non_tensor_bytes(measured, cublas_workspace_bytes(major=major), made)


def cap_bytes(budget_bytes: int, non_tensor: int) -> int:
    """The allocator cap for a budget of tensor bytes (Note [Budget and the allocator])."""
    return (
        int(budget_bytes)
        + int(non_tensor)
        + int(budget_bytes) // HEADROOM_FRACTION
        + HEADROOM_BYTES
    )


def allocated_bytes(device: torch.device) -> int:
    """The caching allocator's ``allocated_bytes.all.current`` for ``device``, read from the
    C++ stats dict directly.

    # Note: [Cheap memory counter]
    # ``torch.cuda.memory_allocated`` builds the nested stats dict, then flattens and sorts its
    # ~120 entries in Python on every call; passive and dynamic mode read the counter before
    # and after every op, which made them host-bound. The nested dict is the same numbers
    # without the flattening.
    """
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:  # pragma: no cover - a torch without the binding
        return torch.cuda.memory_allocated(device)
    return int(stats(device.index)["allocated_bytes"]["all"]["current"])


def resolve_run_device(device, plan, source: str = "") -> torch.device:
    """The device a run manages: ``device`` when named (``cpu``, ``cuda``, ``cuda:N``); for None or
    ``auto`` the plan's device, and without a plan ``cpu`` where CUDA is not available; on a host
    with CUDA a plan-less run must name it (only the script's tensors tell, and they exist only
    once it runs: refusing beats managing the wrong memory). An index-less ``cuda`` is this
    rank's device (``per_rank_cuda``)."""
    if device is None or str(device) == "auto":
        if plan is not None:
            device = plan.provenance.device or "cpu"
        elif torch.cuda.is_available():
            raise PlanFormatError(
                "a budget without a plan on a host with CUDA: name the device to manage "
                "(capuchin run --device cuda or --device cpu; Runtime(..., device=...))"
            )
        else:
            device = "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = per_rank_cuda()
    return dev


def per_rank_cuda() -> torch.device:
    """This process's CUDA device for an index-less ``cuda``.

    # Note: [Per-rank device]
    # Under torchrun every rank sees every GPU and selects its own with
    # ``torch.cuda.set_device(LOCAL_RANK)`` inside the script, after ``capuchin run`` has
    # entered the runtime: ``current_device()`` then is still 0 on every rank, which capped,
    # counted and streamed on GPU 0 for all of them. ``LOCAL_RANK`` names the rank's device
    # before the script runs (one process per GPU, torchrun's convention).
    """
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def determinism_problem(device: torch.device, replays: bool) -> str | None:
    """Why bit-identity cannot be promised on ``device`` for a run that ``replays`` ops
    (recompute decisions, dynamic mode's drops), or None.

    # Note: [Determinism precondition]
    # Replaying an op must give the bytes it gave the first time. On CPU every op capuchin
    # replays is deterministic; on CUDA atomics-based kernels (convolution backward, index_add,
    # scatter_add, embedding backward, ...) and cuBLAS's split-K reductions are not, unless
    # ``torch.use_deterministic_algorithms(True)`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or
    # ``:16:8``) and ``torch.backends.cudnn.benchmark = False``. Without them, a replayed
    # storage can differ from the one the rest of the step already used. Swapping copies bytes
    # and needs none of it.
    """
    if device.type != "cuda" or not replays:
        return None
    missing = []
    if not torch.are_deterministic_algorithms_enabled():
        missing.append("torch.use_deterministic_algorithms(True)")
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        missing.append("CUBLAS_WORKSPACE_CONFIG=:4096:8")
    if torch.backends.cudnn.benchmark:
        missing.append("torch.backends.cudnn.benchmark=False")
    if not missing:
        return None
    return (
        "capuchin: warning: replaying ops on CUDA is bit-identical only with deterministic "
        f"kernels; missing: {', '.join(missing)} (docs/runtime.md, On CUDA)"
    )


# PyTorch's CUDA kernels that are nondeterministic (atomics) unless
# ``torch.use_deterministic_algorithms(True)`` selects another (its documentation's list; the
# ``nondeterministic_bitwise`` op tag is set on none of them). Overload packet names.
NONDETERMINISTIC_ON_CUDA = frozenset(
    {
        "aten.index_add",
        "aten.index_add_",
        "aten.index_put",
        "aten.index_put_",
        "aten._index_put_impl_",
        "aten.put_",
        "aten.scatter_add",
        "aten.scatter_add_",
        "aten.scatter_reduce",
        "aten.scatter_reduce_",
        "aten.embedding_dense_backward",
        "aten._embedding_bag_backward",
        "aten._embedding_bag_dense_backward",
        "aten._embedding_bag_per_sample_weights_backward",
        "aten.convolution_backward",
        "aten.cudnn_convolution",
        "aten.cudnn_convolution_transpose",
        "aten.max_pool3d_with_indices_backward",
        "aten.avg_pool3d_backward",
        "aten.adaptive_avg_pool2d_backward",
        "aten._adaptive_avg_pool2d_backward",
        "aten.adaptive_avg_pool3d_backward",
        "aten._adaptive_avg_pool3d_backward",
        "aten.adaptive_max_pool2d_backward",
        "aten.adaptive_max_pool3d_backward",
        "aten.fractional_max_pool2d_backward",
        "aten.fractional_max_pool3d_backward",
        "aten.max_unpool2d",
        "aten.max_unpool3d",
        "aten.upsample_linear1d_backward",
        "aten.upsample_bilinear2d_backward",
        "aten.upsample_bicubic2d_backward",
        "aten.upsample_trilinear3d_backward",
        "aten.reflection_pad1d_backward",
        "aten.reflection_pad2d_backward",
        "aten.reflection_pad3d_backward",
        "aten.replication_pad1d_backward",
        "aten.replication_pad2d_backward",
        "aten.replication_pad3d_backward",
        "aten.nll_loss2d_forward",
        "aten.grid_sampler_2d_backward",
        "aten.grid_sampler_3d_backward",
        "aten._ctc_loss_backward",
        "aten.histc",
        "aten.bincount",
        "aten.cumsum",
        "aten.kthvalue",
    }
)


def replays_exactly(func, device_type: str) -> bool:
    """Whether replaying op ``func`` on ``device_type`` gives the bytes it gave the first time
    (Note [Determinism precondition]): a drop whose replay does not is swapped instead."""
    if device_type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return True
    name = str(func)
    return name.rsplit(".", 1)[0] not in NONDETERMINISTIC_ON_CUDA


# Note: [Out-of-memory errors caught inside an op]
# Under the cap, an allocation can fail inside an op that catches the error itself: cuDNN's
# convolution (aten/src/ATen/native/cudnn/Conv_v8.cpp ``try_plans``) catches the out-of-memory
# error of its workspace, runs the next engine (other kernels, other bits) and caches that
# choice for the rest of the process. The run is then no longer bit-identical to training
# without capuchin, and nothing reaches capuchin's handlers. Whether a workspace fits is known
# only when the op runs, so it cannot be refused up front; what can be done: every
# out-of-memory error capuchin catches is counted (``caught_oom``), the allocator counts every
# one it raises (``num_ooms``), and at each iteration's end a difference means an op swallowed
# one: the run says so in one warning naming the iteration (``OOMWatch``). A plan whose ops
# include convolutions gets a warning up front when it runs under a cap with cuDNN enabled
# (``cudnn_problem``). The remedies (docs/runtime.md, On CUDA): a larger budget (the cap's
# headroom grows with it), or cuDNN disabled (``torch.backends.cudnn.enabled = False``) in the
# runs compared.
_caught = [0]


def caught_oom() -> None:
    """Count an out-of-memory error that reached capuchin's handlers (whether it then made
    room and retried or let it go to the script)."""
    _caught[0] += 1


def allocator_ooms(device: torch.device) -> int:
    """The caching allocator's count of the out-of-memory errors it raised on ``device``."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:  # pragma: no cover - a torch without the binding
        return int(torch.cuda.memory_stats(device).get("num_ooms", 0))
    return int(stats(device.index).get("num_ooms", 0))


class OOMWatch:
    """Out-of-memory errors the allocator raised on ``device`` that never reached capuchin
    (Note [Out-of-memory errors caught inside an op])."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start = (allocator_ooms(device), _caught[0])
        self.warned = False

    def swallowed(self) -> int:
        raised, caught = allocator_ooms(self.device) - self._start[0], _caught[0] - self._start[1]
        return max(0, raised - caught)

    def problem(self, iteration: int) -> str | None:
        """The warning to give once, at the end of ``iteration``, or None."""
        if self.warned:
            return None
        n = self.swallowed()
        if n == 0:
            return None
        self.warned = True
        return (
            f"capuchin: warning: by iteration {iteration}, {n} out-of-memory error(s) under the "
            "allocator cap were caught inside an op and never reached capuchin (cuDNN does this "
            "with a convolution's workspace, then uses another algorithm for the rest of the "
            "process): results may no longer be bit-identical to training without capuchin; "
            "give the run a larger budget, or disable cuDNN in both runs (docs/runtime.md, On CUDA)"
        )


CUDNN_OPS = ("aten.convolution", "aten._convolution", "aten.cudnn_convolution")


def cudnn_problem(device: torch.device, op_names, cap: int | None) -> str | None:
    """The up-front warning of Note [Out-of-memory errors caught inside an op] for a run on
    ``device`` under allocator cap ``cap`` whose ops are ``op_names``, or None."""
    if device.type != "cuda" or cap is None or not torch.backends.cudnn.enabled:
        return None
    if not any(str(n).startswith(CUDNN_OPS) for n in op_names):
        return None
    return (
        f"capuchin: warning: convolutions run under an allocator cap of {cap / 2**20:.0f} MiB: "
        "where cuDNN's workspace does not fit, cuDNN catches the error and uses another "
        "algorithm (other bits); capuchin warns if that happens (docs/runtime.md, On CUDA)"
    )
