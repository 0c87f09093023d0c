"""Development tools shared by tests/ and benchmarks/ (not installed: pyproject packages only megatron_gspo).

torchrun.py launches a script under torchrun on this machine; check_report.py is the format of the
lines a worker's named checks print and how the launcher reads them back. Test and benchmark files
import them as `devtools.*` with the repository root on sys.path (tests/conftest.py puts it there;
each benchmark inserts it itself; the launcher puts it on its workers' PYTHONPATH).
"""
