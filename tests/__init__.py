"""The test suite, a package so that tests, benchmarks and tools can `import tests.torchrun`."""
