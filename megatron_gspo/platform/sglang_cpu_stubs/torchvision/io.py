"""CPU TEST SCAFFOLDING (see ../README.md)."""
from torchvision._placeholder import ImageReadMode, unavailable  # noqa: F401

decode_image = unavailable("io.decode_image")
decode_jpeg = unavailable("io.decode_jpeg")
