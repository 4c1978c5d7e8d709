"""gafused: fused, correctly scaled gradient accumulation for PyTorch."""

from gafused import ops
from gafused.accumulator import GradAccumulator
from gafused.buffer import FlatGradBuffer
from gafused.checks import check_model
from gafused.ops import available_backends

__all__ = ["FlatGradBuffer", "GradAccumulator", "available_backends", "check_model", "ops"]
__version__ = "0.1.0"
