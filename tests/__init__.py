"""The test suite, a package so that test files can import shared helpers as `tests.*` (tests/tiny_hf.py,
tests/sglang/sglang_test_utils.py). The torchrun launcher the tests share with the benchmarks is
devtools/torchrun.py."""
