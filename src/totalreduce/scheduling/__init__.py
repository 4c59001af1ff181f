"""How ops get their identity and start: self-guided (each rank alone, at once) or
negotiated (when a coordinator says every rank has asked for them)."""

from .handle import Handle
from .negotiated import Negotiated
from .ops import ReduceOp
from .protocol import Scheduler
from .selfguided import SelfGuided

__all__ = ["Handle", "Negotiated", "ReduceOp", "Scheduler", "SelfGuided"]
