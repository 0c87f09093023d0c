"""CPU TEST SCAFFOLDING (see ../../README.md)."""
from torchvision._placeholder import InterpolationMode, unavailable  # noqa: F401

pil_to_tensor = unavailable("transforms.functional.pil_to_tensor")
to_tensor = unavailable("transforms.functional.to_tensor")
resize = unavailable("transforms.functional.resize")
