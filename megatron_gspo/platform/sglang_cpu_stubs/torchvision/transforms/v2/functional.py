"""CPU TEST SCAFFOLDING (see ../../../README.md)."""
from torchvision._placeholder import InterpolationMode, unavailable  # noqa: F401

resize = unavailable("transforms.v2.functional.resize")
