"""Engine adapters. Only hmacore.integrations.vllm imports vLLM."""
