"""Fidelity tools: teacher-forced log-probabilities (Model.logprobs) and KL divergence against
a base run in llama-perplexity's file format (kld.py)."""
