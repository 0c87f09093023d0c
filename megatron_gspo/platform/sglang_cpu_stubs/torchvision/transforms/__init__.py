"""CPU TEST SCAFFOLDING (see ../../README.md)."""
from torchvision._placeholder import InterpolationMode  # noqa: F401
from torchvision.transforms import functional, v2  # noqa: F401
