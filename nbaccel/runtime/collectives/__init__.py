"""Collective operations on tensor trees: gather, reduce, broadcast, pad, and the trees they walk."""
