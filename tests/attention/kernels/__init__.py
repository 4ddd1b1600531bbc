"""Tests of the attention kernels (``mmtier.attention.kernels``), and in ``test_triton.py``
of the page-write kernels they share the oracle cases with (``mmtier.pages.kernels``)."""
