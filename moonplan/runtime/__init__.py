"""The multi-rank runtime: expert store and prefetch, dispatch and combine, grouped experts."""
