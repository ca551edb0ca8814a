"""The bottom of the stack, imported by every other part and importing none of them: the
exceptions glm_fp8 raises (``errors``), the block-FP8 contract's constants (``numerics``), the
string vocabularies (transfer mode, wire format, scale format, ...) and their one check
(``vocab``), and the argument checks the entry points share (``checks``)."""
