"""How a kernel's iteration space is cut into programs: block sizes and warps.

Fusion asks two questions of it (does a reduced row fit one block, so later values of the
row can use the reduction in the same kernel; how many programs would a reduction get, so a
starved one is split in two stages) and codegen asks for the tiles and warps to launch with.

The rules follow the shape of Inductor's heuristics (torch/_inductor/runtime/
triton_heuristics.py: ``triton_config``, ``triton_config_reduction``,
``_persistent_reduction_configs``, ``_reduction_configs``' outer configs; and
torch/_inductor/ir.py ``Reduction.num_splits``), with our own constants:
- a block should hold enough contiguous elements per thread for 16-byte vector loads
  (4 fp32, 8 bf16, 2 fp64), and no more per live value than the register file allows:
  more values live at once (loads, accumulators, rows held across a reduction) means fewer
  elements per thread, reached by more warps or, past 16 warps, a smaller block;
- a reduction over the contiguous dim ("inner") puts the block along the row; one over
  other dims ("outer": column sums, bias and norm-weight gradients) puts a tile of
  contiguous columns in the block and loops over rows, so loads are coalesced;
- a grid under two programs per SM (H100: 132 SMs) leaves the GPU idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.ir.graph import numel

SM_COUNT = 132                   # H100 SXM
MIN_PROGRAMS = 2 * SM_COUNT      # fewer programs than this starve the GPU
PERSISTENT_MAX = 4096            # an inner reduced row up to this size is held in one block
OUTER_PERSISTENT_MAX = 64        # an outer one: the block also holds a tile of >= 32 columns
RBLOCK_MAX = 2048                # a looped row is taken in steps of at most this many elements
MAX_WARPS = 16
REGISTER_BUDGET = 64             # registers per thread for block values (of 255), the rest for indices and temporaries
# Long rows held whole (see ``holds_row``): one row a block, at CUDA's most threads a block.
# NOTE: measured with the sm_90 compile (benchmarks/sm90.py), 32 warps: softmax holds rows of 16384
# at 37-38 registers (forward) and 52-56 (backward, two row values), rows of 32768 at 54 (fp32
# forward: one value, 32 elements a thread) and 64 (bf16, the cap, no spills); a row of 32768 with
# two values (softmax's backward) cannot fit: 64 registers of data alone. (A long row's max is
# written to hold no second row value: codegen/reductions.py ``reduce_row``.)
LONG_ROW_MAX = 32768             # no longer row is held whole: even one value would not fit the registers
LONG_ROW_WARPS = 32              # 1024 threads, as PyTorch's softmax kernels launch for long rows
# A looped row read again by a second loop over it (``rereads_row_from_l2``)
L2_BYTES = 50 * 2**20            # H100 SXM's L2 cache
TWO_PASS_WARPS = 32              # at most 2 such programs an SM (64 warps), so few rows are in flight
TWO_PASS_RBLOCK = 4096           # 4 elements a thread each step: 16-byte fp32 loads
REGISTER_FILE = 65536            # 32-bit registers of an SM (and the most one block may use)
RESERVED_REGISTERS = 24          # per thread, besides the row's values: index, masks, addresses, reduction scratch


@dataclass(frozen=True)
class Tiling:
    xblock: int
    rblock: int
    num_warps: int

    def programs(self, xnumel: int) -> int:
        return -(-xnumel // self.xblock)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def is_outer(shape, reduce_dims) -> bool:
    """Whether a reduction keeps the innermost dim (of size > 1): its contiguous elements
    belong to different outputs, so a block should span outputs, not the row."""
    for d in reversed(range(len(shape))):
        if shape[d] != 1:
            return d not in reduce_dims
    return False


def fits_one_block(shape, reduce_dims) -> bool:
    """Whether a reduced row is held whole in one block (a persistent reduction)."""
    if not reduce_dims:
        return False
    rnumel = numel([shape[d] for d in reduce_dims])
    return rnumel <= (OUTER_PERSISTENT_MAX if is_outer(shape, reduce_dims) else PERSISTENT_MAX)


def holds_row(shape, reduce_dims, row_values: int = 1, wide_values: bool = False) -> bool:
    """Whether a kernel over ``shape`` holds each reduced row whole in one block (persistent),
    so values computed after the row's reduction (softmax's division, its backward's product)
    read the row from registers instead of memory again: rows that ``fits_one_block``, and
    inner rows up to LONG_ROW_MAX whose values fit the registers of one block.

    ``row_values``: row-shaped values held across the row's reductions (the buffers it reads
    in full rows: softmax forward 1, its backward 2); ``wide_values``: fp64, two registers
    an element.

    A long row runs one a block at LONG_ROW_WARPS (1024 threads); a thread then holds
    rblock / 1024 elements of each value, and may use REGISTER_FILE / 1024 = 64 registers (a
    block's registers come from one SM's file), RESERVED_REGISTERS of them for everything
    else. Past that a row spills, and a looped kernel (an online max-and-sum, then a second
    pass) is cheaper than local memory traffic. Why this is the rule:
    - LONG_ROW_MAX and RESERVED_REGISTERS are set from the sm_90 compile (see LONG_ROW_MAX).
    - PyTorch's aten/src/ATen/native/cuda/SoftMax.cu (not in the wheel) keeps a row on chip
      when it fits: ``cunn_SoftMaxForwardSmem`` runs when the row's bytes fit the shared
      memory (``dim_size < max_elements_per_smem``) and reads the row once; Triton has no
      explicit shared-memory row, registers are its on-chip store, so the bound here is the
      register file instead.
    - Inductor (torch/_inductor/choices.py ``should_use_persistent_reduction``) holds an inner
      row whole up to 1024 elements by default, and up to 16x that (16384) with
      ``multi_kernel``, which compiles the looped kernel too and benchmarks the two on the GPU;
      torch/_inductor/runtime/triton_heuristics.py ``_persistent_reduction_configs`` picks the
      warps from the block's elements. Without a GPU to benchmark on, this rule is checked
      instead by compiling for sm_90 (tests/test_hopper_compile.py asserts no spills at the longest
      rows the rule admits).

    >>> [holds_row((8192, 16384), (1,), row_values=n) for n in (1, 2, 3)]
    [True, True, False]
    >>> [holds_row((8192, 32768), (1,), row_values=n) for n in (1, 2)], holds_row((8192, 65536), (1,))
    ([True, False], False)
    """
    if not reduce_dims:
        return False
    if fits_one_block(shape, reduce_dims):
        return True
    if is_outer(shape, reduce_dims):
        return False
    rnumel = numel([shape[d] for d in reduce_dims])
    if rnumel > LONG_ROW_MAX:
        return False
    threads = 32 * LONG_ROW_WARPS
    per_thread = -(-next_pow2(rnumel) // threads)
    need = max(1, row_values) * per_thread * (2 if wide_values else 1) + RESERVED_REGISTERS
    return need <= min(255, REGISTER_FILE // threads)


def rereads_row_from_l2(shape, reduce_dims, row_itemsizes) -> bool:
    """Whether a kernel that loops over each row twice (its reductions, then the values that read
    them: softmax's backward past ``holds_row``) finds the row in L2 on its second loop, so it
    moves the row's bytes from memory once. ``row_itemsizes``: the element size of each row-shaped
    buffer the second loop reads again.

    Such a kernel runs one row a program at TWO_PASS_WARPS (1024 threads), so an SM runs at most
    2 of them (64 warps) and SM_COUNT * 2 rows are in flight. Between a program's first and
    second read of an element, the programs in flight each stream one row pass; about half of
    them are in their first pass (bringing new lines into L2), so the reuse distance is about
    SM_COUNT rows' bytes, which must fit L2_BYTES. This is the shape of eager's own kernel: CUDA's
    cunn_SoftMaxBackward (aten/src/ATen/native/cuda/SoftMax.cu) reads gradOutput and output once
    for the row's sum and again to write, one row a block, and the kernel model
    (benchmarks/README.md) counts eager's row as read once too.
    NOTE: an estimate, not a measurement: L2 is two partitions, and lines are not kept in LRU order.

    >>> rereads_row_from_l2((8192, 32768), (1,), [4, 4]), rereads_row_from_l2((8192, 65536), (1,), [4, 4])
    (True, False)
    """
    if not reduce_dims or is_outer(shape, reduce_dims):
        return False
    rnumel = numel([shape[d] for d in reduce_dims])
    return SM_COUNT * rnumel * sum(row_itemsizes) <= L2_BYTES


def _elements_per_thread(live_values: int, wide_values: bool) -> int:
    """Elements of each block value a thread holds: 8 (two 16-byte fp32 vectors, one of
    bf16) when few values are live, fewer as more are (the register budget), never under 2."""
    words = 2 if wide_values else 1
    budget = _prev_pow2(max(1, REGISTER_BUDGET // (max(1, live_values) * words)))
    return max(2, min(budget, 8))


def _warps_for(tile: int, per_thread: int, max_warps: int = MAX_WARPS) -> int:
    return max(1, min(max_warps, tile // (32 * per_thread)))


def size_bucket(n: int) -> int:
    """The size a shape-generic kernel's blocks are chosen for, for a dim of ``n`` elements: the
    smallest odd power of two at or above it (2, 8, 32, 128, 512, 2048, ...).

    Why these: the buckets are 4x wide, so a block chosen for the top of a bucket holds at most 4x
    the elements of the smallest row in it (masked lanes of a short row are cheap: a row of 16
    in a block of 32, one of 33 in 128); narrower buckets would give more compiled versions of a
    kernel over a range of lengths (16..128 spans two: 32 and 128), wider ones a row of a few
    elements in a block of hundreds. The boundaries sit at odd powers of two so that the usual
    maximum lengths (128, 512, 2048) fill their block exactly.

    >>> [size_bucket(n) for n in (1, 2, 3, 16, 17, 32, 33, 100, 128, 129)]
    [2, 2, 8, 32, 32, 32, 128, 128, 128, 512]
    """
    bucket = 2
    while bucket < n:
        bucket *= 4
    return bucket


def _generic_sizes(shape, rdims, xnumel: int, rnumel: int, persistent: bool) -> tuple:
    """(xnumel, rnumel) a shape-generic kernel chooses its blocks for (``choose_tiling``), so that
    every size in one bucket gives the same blocks and warps, hence the same source text.

    - The rows (xnumel) are taken as unbounded: a block is as wide as the other caps allow,
      whatever the count (a small kernel then has a few masked lanes in one program: it is bound
      by its launch anyway, and a per-count block would be a new version for each power of two).
      One row (a full reduction: a count of 1 is a literal, part of the guard key) looped over is
      taken in the largest steps whatever its length: one program, launch-bound when short.
    - A reduced row (rnumel) is its ``size_bucket``; a row held whole (persistent) keeps that under
      the most a block holds (PERSISTENT_MAX, OUTER_PERSISTENT_MAX) where its exact size fits: the
      fusion decided the row fits by its exact size. A long row held whole (past PERSISTENT_MAX, at
      most LONG_ROW_MAX, one row a block at 32 warps) keeps its exact power of two: ``holds_row``
      checked that one against the register file, not a 4x larger one.
    """
    unbounded = 1 << 40
    if xnumel == 1 and not persistent:
        return 1, unbounded      # one row (a full reduction): the largest step, whatever its length
    xnumel = unbounded
    cap = OUTER_PERSISTENT_MAX if is_outer(shape, rdims) else PERSISTENT_MAX
    if not persistent or next_pow2(max(rnumel, 1)) <= cap:
        bucket = size_bucket(rnumel)
        rnumel = min(bucket, cap) if persistent else bucket
    return xnumel, rnumel


def choose_tiling(shape, reduce_dims, *, persistent: bool | None = None, live_values: int = 1,
                  wide_values: bool = False, two_pass: bool = False, shape_generic: bool = False) -> Tiling:
    """Blocks and warps for a kernel over ``shape`` reducing ``reduce_dims``.

    ``persistent``: rows are held whole (default: when they fit one block);
    ``live_values``: block-shaped values held at once (an estimate from the kernel body);
    ``wide_values``: the kernel computes in 64-bit (fp64), two registers per element;
    ``two_pass``: a looped row is read by a second loop (``rereads_row_from_l2``): one row a program;
    ``shape_generic``: blocks for the sizes' buckets, not the sizes (``_generic_sizes``): the same
    tiling for every size of a bucket, so a kernel whose sizes are arguments has one source for them.

    >>> choose_tiling((4096, 1024), (1,), live_values=8)
    Tiling(xblock=1, rblock=1024, num_warps=4)
    """
    rdims = tuple(reduce_dims)
    xnumel = numel([s for d, s in enumerate(shape) if d not in rdims])
    rnumel = numel([shape[d] for d in rdims])
    per_thread = _elements_per_thread(live_values, wide_values)
    if persistent is None:
        persistent = bool(rdims) and fits_one_block(shape, rdims)
    if shape_generic:
        xnumel, rnumel = _generic_sizes(shape, rdims, xnumel, rnumel, persistent)
    if not rdims:
        # NOTE: not shrunk to fill the SMs: a small elementwise kernel is bound by its launch
        xblock = min(next_pow2(max(xnumel, 1)), 1024)
        warps = _warps_for(xblock, per_thread, 8)
        while xblock > 32 * warps * per_thread:   # too many elements per thread even at 8 warps
            xblock //= 2
        return Tiling(xblock, 1, warps)
    outer = is_outer(shape, rdims)
    if two_pass:
        return Tiling(1, min(next_pow2(max(rnumel, 1)), TWO_PASS_RBLOCK), TWO_PASS_WARPS)
    if persistent and next_pow2(max(rnumel, 1)) > PERSISTENT_MAX and not outer:
        return Tiling(1, next_pow2(rnumel), LONG_ROW_WARPS)     # a long row held whole (``holds_row``)
    if persistent:
        rblock = next_pow2(max(rnumel, 1))
        # whole rows, up to 4096 elements a block; a long row alone (as Inductor's persistent
        # reductions over rows > 1024), a tile of columns when outer
        most = 128 if outer else (1 if rblock >= 1024 else 64)
        xblock = max(1, min(next_pow2(max(xnumel, 1)), max(1, 4096 // rblock), most))
    elif outer:
        xblock = min(next_pow2(max(xnumel, 1)), 64)
        rblock = min(next_pow2(max(rnumel, 1)), max(1, RBLOCK_MAX // 2 // xblock))
    else:
        rblock = min(next_pow2(max(rnumel, 1)), RBLOCK_MAX if live_values <= 4 else RBLOCK_MAX // 2)
        xblock = max(1, min(next_pow2(max(xnumel, 1)), RBLOCK_MAX // 2 // rblock, 64))   # short rows: several
    # NOTE: 16 warps leave a thread 128 of its 255 registers (65536 per SM partition); a heavy
    # body (two elements a thread) spills there, so it takes a smaller tile at 8 warps instead
    warps = _warps_for(xblock * rblock, per_thread, MAX_WARPS if per_thread > 2 else 8)
    while xblock * rblock > 32 * warps * per_thread:   # too many elements per thread even at the most warps
        if xblock > 1 and (persistent or not outer):
            xblock //= 2     # fewer rows
        elif not persistent and rblock > 1:
            rblock //= 2     # a looped row in smaller steps
        else:
            break
    return Tiling(xblock, rblock, warps)


def reduction_programs(shape, reduce_dims) -> int:
    """Programs a reduction over ``shape`` would run as (for the split decision)."""
    xnumel = numel([s for d, s in enumerate(shape) if d not in reduce_dims])
    return choose_tiling(shape, reduce_dims).programs(xnumel)
