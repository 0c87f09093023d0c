"""CPU TEST SCAFFOLDING: an import stand-in for torchvision (see ../README.md).

PyPI's torchvision does not load beside torch 2.13.0+cpu; SGLang and transformers import it at start-up
but only image/video code uses it. Every placeholder raises when used.
"""
__version__ = "0.28.0"  # must parse: transformers compares it

from torchvision import io, transforms  # noqa: E402,F401
