"""CPU TEST SCAFFOLDING (see ../../README.md): names SGLang's quantization modules read at import."""


class ScalarType:
    """Placeholder: only used by quantized kernels, which a CPU test never runs."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"ScalarType({self.name!r}) (CPU import stand-in)"


class scalar_types:  # noqa: N801  (SGLang's spelling)
    uint4 = ScalarType("uint4")
    uint4b8 = ScalarType("uint4b8")
    uint8 = ScalarType("uint8")
    uint8b128 = ScalarType("uint8b128")
