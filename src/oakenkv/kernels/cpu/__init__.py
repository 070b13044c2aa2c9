"""numba CPU kernels, compiled once into numba's on-disk cache and bit-exact with ``oakenkv.quant``.

- ``codec``: ``encode_batch`` / ``decode_batch`` (rows, multi-threaded), ``encode_records`` / ``decode_records``
  (rows straight into page records and back), and the ``@njit`` row helpers other kernels inline.
- ``attention``: decode attention over a layer's packed pages (a ``format.layout.LayerView``) and the merges of
  sink tokens and a full-precision window through the log-sum-exp; ``split_work``, its rule for threads.
- ``rotate``: oaken-plus's online key transform (a shift, then a per-head Walsh-Hadamard transform).
- ``helpers``: fp16 conversions, borrowed array views and LLVM intrinsics the kernels share.

Nothing is imported here (numba compiles on first use), but numba's threads are started here, once, keeping
torch's thread count (:func:`_launch_threads_keeping_torch`).
"""


def _launch_threads_keeping_torch() -> None:
    """Start numba's threading layer and give torch back its thread count.

    numba starts its threading layer on the first parallel launch, and its OpenMP layer then sets the process's
    OpenMP thread count to ``NUMBA_NUM_THREADS``, which is torch's too: under ``OMP_NUM_THREADS=1`` torch computed on
    every core from the first kernel call on, so its sums (and a search's thresholds, in the 7th digit) depended on
    whether a kernel had run before. numba keeps its own count (``numba.set_num_threads``) after torch's is reset.
    """
    import torch
    from numba.np.ufunc.parallel import _launch_threads

    n = torch.get_num_threads()
    try:
        _launch_threads()
    except Exception:  # (no threading layer loads: the first parallel kernel raises numba's own error)
        return
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


_launch_threads_keeping_torch()
