"""How ops get their identity and start: self-guided (no negotiation) for now."""

from .handle import Handle
from .ops import ReduceOp
from .selfguided import SelfGuided

__all__ = ["Handle", "ReduceOp", "SelfGuided"]
