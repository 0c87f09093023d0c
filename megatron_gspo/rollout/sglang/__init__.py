"""Everything that speaks to SGLang: launching servers (server.py, serve.py), the async HTTP client with
failover (client.py), the MoE routing it returns (routed_experts.py), the weight-sync transports
(weight_sync.py) and the backend that ties them together for the trainer (backend.py).
The trainer never imports SGLang: servers run in their own environment and are reached over HTTP.
"""
