"""Pods: the registry (one source of truth) and the loops that keep it current."""
