"""The lower tiers as the cache sees them: ``lower`` (the host and disk copies of groups, promotion and spills), ``room`` (making room on the device), ``leases`` (read leases)."""
