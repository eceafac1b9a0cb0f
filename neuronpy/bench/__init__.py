"""`neuronpy bench`: neuronpy against its peers on the same model, prompts, dtype and device.

Workloads and metrics follow shared/bench.md (metrics as vLLM's `vllm bench serve` defines them).
`python -m neuronpy.bench --help` lists the flags.
"""
