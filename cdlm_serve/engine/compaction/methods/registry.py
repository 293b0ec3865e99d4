"""The compaction methods by the name requests use (`method`): the built-in ones register
themselves when `engine.compaction.methods` is imported, a new one when its file is."""

from __future__ import annotations

from cdlm_serve.engine.compaction.methods.base import CompactionMethod
from cdlm_serve.engine.registry import Registry

_METHODS = Registry[CompactionMethod]("compaction method")
METHODS = _METHODS.items
register = _METHODS.register
unregister = _METHODS.unregister
method = _METHODS.get  # ValueError naming the known methods if `name` is none of them
