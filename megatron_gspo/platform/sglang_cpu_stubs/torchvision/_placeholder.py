"""CPU TEST SCAFFOLDING: placeholders that raise when used (see ../README.md)."""
import enum


def unavailable(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"torchvision.{name} is a CPU import stand-in "
                                  "(megatron_gspo/platform/sglang_cpu_stubs): image/video input is not supported here")
    stand_in.__name__ = name.rsplit(".", 1)[-1]
    return stand_in


class InterpolationMode(enum.Enum):
    """Same member names as torchvision's, so module-level tables that name them import."""
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
