"""Storage: the page pool (``pages``, the software MMU) and the paged K/V store (``paged``)."""
