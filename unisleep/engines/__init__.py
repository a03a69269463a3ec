"""Rollout-engine adapters: vLLM over HTTP, vLLM in process, and the plain PyTorch generator."""
