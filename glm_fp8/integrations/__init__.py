"""Integrations with the frameworks around us: prime-rl's trainer-side conversion
(``prime_rl``). Each imports its framework lazily, if at all: nothing here is needed to import
glm_fp8."""
