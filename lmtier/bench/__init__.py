"""Microbenchmarks (``lmtier bench ...``)."""
