"""Signed, append-only partition archives in Hypercore 11's format.

Synchronous and Trio-free; never imports `broker` or protocol types.
"""
