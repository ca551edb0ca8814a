"""Integrations with the frameworks around glm_fp8: prime-rl's trainer-side conversion
(``prime_rl``), Megatron-Core trainers' models as their senders' layers (``megatron``; a small
GLM-5 built by Megatron-Core on a CPU for the tests and the example, ``megatron_cpu``), vLLM
0.34's weight-transfer backend and worker extension (``vllm/``), and SGLang 0.5.23's custom
weight loader and the trainer's client of its HTTP API (``sglang/``). Each imports its framework
lazily, if at all: nothing here is needed to import glm_fp8."""
