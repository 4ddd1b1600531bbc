"""The core's data types, at the bottom of the package graph: modality groups and their tiers
(``groups``), segments and sequence tables (``segments``), the parent links of chained groups
(``lineage``), the cache's lock (``locking``) and the check of a caller's key against the
config (``key_checks``). Content keys are ``mmtier.content``. Everything
above imports these; they import nothing of the cache, its tiers, attention, eviction or actors.
"""
