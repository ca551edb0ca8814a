"""Integrations with the frameworks around glm_fp8: prime-rl's trainer-side conversion
(``prime_rl``), Megatron-Core trainers' models as their senders' layers (``megatron``), and vLLM
0.34's weight-transfer backend and worker extension (``vllm/``). Each imports its framework
lazily, if at all: nothing here is needed to import glm_fp8."""
