"""Reading COO streams in Triton: a block of bytes of many tokens' streams at once, no per-byte loop.

The decoder of ``docs/format.md`` is a walk: an escape is recognised by comparing a byte with the previous entry
byte, and an entry's chunk is the sum of the advances before it. Both become data-parallel:

* **Roles by a scan over byte transitions.** Before each byte the walker is in one of four states: ``N`` (the
  previous byte was an entry, or the stream starts: the next byte is an entry or, if it repeats the previous
  byte, an escape), ``E`` (after an escape: an advance byte follows), ``A`` (after an ``0xFF`` advance byte:
  another advance byte follows) and ``X`` (after an advance's last byte: an entry follows, never an escape).
  Byte ``j``'s transition depends only on itself and byte ``j - 1`` (which, in state ``N``, is the previous
  entry; the virtual ``0x00`` at the stream start): ``N -> E`` if they are equal else ``N``; ``E, A -> A`` if the
  byte is ``0xFF`` else ``X``; ``X -> N``. A transition is a map of the four states, packed as four 2-bit
  images in an int32; composing maps is associative, so the state before every byte is an exclusive
  ``tl.associative_scan`` of the transitions (each lane holds byte ``j - 1``'s transition, computed from bytes
  ``j - 1`` and ``j - 2``), applied to the state carried in from the previous block of bytes.
* **Chunks by a prefix sum.** An advance byte adds its value (``0xFF`` adds 255, the last byte the rest); an entry
  in state ``N`` whose index is ``<=`` the previous byte's index adds 1 (a natural advance; never at the stream
  start, never right after an escape, where the last index is -1). The chunk of every entry is the carried
  chunk plus the inclusive ``tl.cumsum`` of these increments.

Validation, as the CPU decoder's (``ERR_*`` of ``oakenkv.format.layout``): an entry position ``>= D``, an advance of
0 after an entry, a fifth code bit of a 4-bit group, and a stream that ends inside an escape (state ``E``/``A``:
truncated advance) or right after one (``X``: no entry) are reported, never read past.
"""

from __future__ import annotations

import triton
import triton.language as tl

from oakenkv.kernels.triton import _oaken as F
from oakenkv.kernels.triton.interpret import install

install()  # under TRITON_INTERPRET=1: the interpreter's helper calls without a redundant patch each

#: Walker states (module docstring).
ST_N, ST_E, ST_A, ST_X = 0, 1, 2, 3
#: The identity map of the four states, packed (2 bits per state's image).
IDENTITY = ST_N | ST_E << 2 | ST_A << 4 | ST_X << 6


@triton.jit
def _compose(a, b):
    """The map "a, then b" of two packed state maps."""
    r0 = (b >> (2 * (a & 3))) & 3
    r1 = (b >> (2 * ((a >> 2) & 3))) & 3
    r2 = (b >> (2 * ((a >> 4) & 3))) & 3
    r3 = (b >> (2 * ((a >> 6) & 3))) & 3
    return r0 | (r1 << 2) | (r2 << 4) | (r3 << 6)


@triton.jit
def _transition(e, e1):
    """Packed state map of a byte ``e`` whose previous byte is ``e1`` (0 at the stream start)."""
    t_n = tl.where(e == e1, 1, 0)  # N -> E on a repeat, else N
    t_ea = tl.where(e == F.ADV_CONTINUE, 2, 3)  # E, A -> A on 0xFF, else X
    return t_n | (t_ea << 2) | (t_ea << 4)  # X -> N (0)


@triton.jit
def _scan_maps(f, SBLK: tl.constexpr, SBLK_LOG: tl.constexpr):
    """Inclusive scan of packed state maps along axis 1 (Hillis-Steele: log2(SBLK) rounds of gather + compose).

    Not ``tl.associative_scan``: the interpreter runs a custom combine element by element, which made the CPU tests
    (``TRITON_INTERPRET=1``) far slower than these whole-block rounds, and on a GPU the six rounds over a 64-lane
    row are as cheap."""
    lane = tl.arange(0, SBLK)[None, :] + tl.zeros_like(f)
    for r in tl.static_range(SBLK_LOG):
        src = tl.gather(f, tl.maximum(lane - (1 << r), 0), axis=1)
        f = tl.where(lane >= (1 << r), _compose(src, f), f)
    return f


@triton.jit
def coo_block(
    sp_ptr, addr, length, jb, state, chunk, D,
    SBLK: tl.constexpr, SBLK_LOG: tl.constexpr, INNER5: tl.constexpr, OUTER5: tl.constexpr,
):  # fmt: skip
    """Bytes ``[jb, jb + SBLK)`` of the COO streams of a vector of tokens.

    Args:
        sp_ptr: uint8 base pointer; ``addr``: int64 ``[BT]`` each stream's first byte (masked-out tokens: any);
            ``length``: int32 ``[BT]`` stream lengths (0 for tokens to skip).
        SBLK = 2 ** SBLK_LOG: bytes per stream and block.
        jb: first byte of the block (the same for every token); ``state``/``chunk``: int32 ``[BT]``, the walker
            state and chunk before byte ``jb`` (``ST_N`` and 0 at the stream start).
        D: values per row; INNER5/OUTER5: whether the inner/outer groups have 5-bit codes.

    Returns:
        ``(entry, pos, e, state, chunk, err)``: bool ``[BT, SBLK]`` the entry bytes, int32 ``[BT, SBLK]`` their
        positions and the bytes, the carried state and chunk after the block, and int32 ``[BT]`` error flags
        (1 position out of range, 2 zero advance, 4 fifth bit of a 4-bit group; the end-of-stream checks are
        :func:`coo_end_error`'s).
    """
    j = jb + tl.arange(0, SBLK)[None, :]  # [1, SBLK]
    inb = j < length[:, None]  # [BT, SBLK]
    base = sp_ptr + addr[:, None]
    e = tl.load(base + j, mask=inb, other=0).to(tl.int32)
    e1 = tl.load(base + j - 1, mask=inb & (j >= 1), other=0).to(tl.int32)
    e2 = tl.load(base + j - 2, mask=inb & (j >= 2), other=0).to(tl.int32)
    # lane j holds byte j - 1's transition (identity in the block's first lane: the carried state covers it)
    f_prev = tl.where(inb & (j > jb), _transition(e1, e2), 0 | (1 << 2) | (2 << 4) | (3 << 6))
    maps = _scan_maps(f_prev, SBLK, SBLK_LOG)
    st = (maps >> (2 * state[:, None])) & 3  # state before byte j
    is_n = st == 0
    entry = inb & ((is_n & (e != e1)) | (st == 3))
    adv = inb & ((st == 1) | (st == 2))
    natural = entry & is_n & (j > 0) & ((e & F.INDEX_MASK) <= (e1 & F.INDEX_MASK))
    inc = tl.where(adv, e, tl.where(natural, 1, 0))
    cabs = chunk[:, None] + tl.cumsum(inc, axis=1)
    pos = cabs * F.CHUNK + (e & F.INDEX_MASK)
    # errors
    err = tl.max(tl.where(entry & (pos >= D), 1, 0), axis=1)
    err |= tl.max(tl.where(inb & (st == 1) & (e == 0) & (j >= 2), 2, 0), axis=1)
    fifth = entry & ((e & F.CODE_BIT4) != 0)
    if not INNER5:
        err |= tl.max(tl.where(fifth & ((e & F.GROUP_BIT) == 0), 4, 0), axis=1)
    if not OUTER5:
        err |= tl.max(tl.where(fifth & ((e & F.GROUP_BIT) != 0), 4, 0), axis=1)
    # carry: the state after the block's last byte of each stream, the chunk after the block
    after = (_transition(e, e1) >> (2 * st)) & 3
    last = tl.minimum(length, jb + SBLK) - 1  # [BT]
    at_last = inb & (j == last[:, None])
    state_out = tl.where(last >= jb, tl.max(tl.where(at_last, after, -1), axis=1), state)
    chunk_out = chunk + tl.sum(inc, axis=1)
    return entry, pos, e, state_out, chunk_out, err


@triton.jit
def coo_end_error(state, length):
    """Error flags of streams that ended in ``state``: 8 escape cut off before its advance ends, 16 advance not
    followed by an entry (empty streams end in ``ST_N``)."""
    return tl.where((length > 0) & ((state == 1) | (state == 2)), 8, tl.where((length > 0) & (state == 3), 16, 0))


@triton.jit
def flags_to_error(flags, E_POS: tl.constexpr, E_ZERO: tl.constexpr, E_FIFTH: tl.constexpr,
                   E_TRUNC: tl.constexpr, E_NOENTRY: tl.constexpr):  # fmt: skip
    """One ``ERR_*`` code (0: fine) from the error flags of :func:`coo_block` / :func:`coo_end_error`."""
    return tl.where(
        (flags & 8) != 0,
        E_TRUNC,
        tl.where(
            (flags & 16) != 0,
            E_NOENTRY,
            tl.where(
                (flags & 2) != 0, E_ZERO, tl.where((flags & 1) != 0, E_POS, tl.where((flags & 4) != 0, E_FIFTH, 0))
            ),
        ),
    )


__all__ = ["IDENTITY", "ST_A", "ST_E", "ST_N", "ST_X", "coo_block", "coo_end_error", "flags_to_error"]

_ = triton  # the decorators above are triton's
