"""The one writer of page records: a token's dense record and its sparse (COO) bytes copied to their addresses.

Every store of Oaken's bytes decides *where* a token's records go in its own way (``oakenkv.store.pages``: dense
pages of ``page_size // rec`` records and sparse pages filled greedily; the vLLM plugin's blocks:
``oakenkv.integrations.vllm.layout``), then hands the addresses to :func:`put_record`, which copies the bytes. So the
bytes of a record are written by one function whatever holds them, and a change of the record format (what a
record is, how long) is made here once.

Addresses are flat byte offsets into the storage (``pool.reshape(-1)``). Kernels: numba, ``cache=True``, no checks
(the callers computed the addresses; they never raise).
"""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def put_record(flat, dense, k, dense_at, sparse, s0, length, sparse_at):
    """Copy record ``k``: ``dense[k]`` (uint8 ``[rec]``) to ``flat[dense_at:]`` and ``sparse[s0:s0 + length]``
    (``sparse`` a flat uint8 array of COO bytes) to ``flat[sparse_at:]``. ``length`` 0 copies no sparse byte (then
    ``sparse_at`` is not read)."""
    rec = dense.shape[1]
    for i in range(rec):
        flat[dense_at + i] = dense[k, i]
    for i in range(length):
        flat[sparse_at + i] = sparse[s0 + i]


@njit(cache=True, nogil=True)
def copy_token_records(flat, dense, dense_at, sparse, lengths, sparse_at):
    """:func:`put_record` for ``m`` records held as rows: ``dense [m, rec]``, ``sparse [m, S]`` (row ``k`` starts with
    its ``lengths[k]`` COO bytes: the encoder's ``encode_records`` layout), to ``dense_at[k]`` and ``sparse_at[k]``
    (``sparse_at[k] < 0``: record ``k`` has no sparse bytes)."""
    width = sparse.shape[1]
    rows = sparse.reshape(-1)
    for k in range(dense.shape[0]):
        a = sparse_at[k]
        put_record(flat, dense, k, dense_at[k], rows, k * width, lengths[k] if a >= 0 else 0, a)


__all__ = ["copy_token_records", "put_record"]
