"""The compaction methods, one object each (`CompactionMethod`): what it needs and how it
picks a head's slots. Adding one is one file that subclasses `CompactionMethod` and calls
`register` (the built-in ones: `attention_matching`, `selection`)."""

from cdlm_serve.engine.compaction.methods import attention_matching, selection  # noqa: F401
from cdlm_serve.engine.compaction.methods.base import CompactionMethod
from cdlm_serve.engine.compaction.methods.registry import METHODS, method, register, unregister

# Under these names in the compaction package (beside the decoding modes' `register`).
register_method = register
unregister_method = unregister

__all__ = [
    "METHODS",
    "CompactionMethod",
    "method",
    "register",
    "register_method",
    "unregister",
    "unregister_method",
]
