"""Platform glue, one module per concern: cpu.py (what Megatron-Core needs on machines without CUDA),
torch_compat.py and megatron_compat.py (private APIs used, each with its upstream file:line), lifetime.py
(Linux: processes that end with the one that started them), sglang_cpu_stubs/ (SGLang's CPU import
stand-ins). Nothing is imported here: lifetime.py is a rank's first import, before torch."""
