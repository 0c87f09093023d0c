"""CPU TEST SCAFFOLDING (see ../../README.md): SGLang probes for this submodule; nothing is used."""
