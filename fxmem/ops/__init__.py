"""Autograd functions the rewrites call: attention in chunks of queries, cross-entropy in chunks of tokens."""
