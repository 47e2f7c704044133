"""Tools over the public API: the memory estimate, batch-size fit and capacity, plan checks, policy tables."""
