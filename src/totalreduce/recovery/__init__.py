"""Rabit-style recovery: survivors keep their processes and memory, a killed worker is
restarted and catches up from its peers' memory (see robust.py)."""
