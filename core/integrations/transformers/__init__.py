"""Run transformers' recurrent and hybrid models with statecache holding every state.

::

    from statecache.integrations.transformers import Engine, StatecacheCausalLM

    lm = StatecacheCausalLM(model, n_seq_max=8, n_rs_seq=4)   # model: a loaded *ForCausalLM
    engine = Engine(lm)
    rid = engine.add(prompt_ids, max_new_tokens=32)
    engine.run()
    print(engine.tokens(rid))

torch and transformers are imported when a model is attached, not when this
package is imported (install ``statecache[transformers]``).  Supported model
types: :func:`supported_model_types`; anything else raises
:class:`UnsupportedModelError` (an :class:`~statecache.errors.IntegrationError`) naming
the model type or layer class; a missing or unsupported torch or transformers raises the
core's :class:`~statecache.errors.IntegrationError`.
"""

from __future__ import annotations

from .draft import NgramDraft
from .engine import Engine, Request, Sampling
from .errors import IntegrationError, UnsupportedModelError
from .families import supported_model_types
from .model import StatecacheCausalLM

__all__ = [
    "Engine",
    "IntegrationError",
    "NgramDraft",
    "Request",
    "Sampling",
    "StatecacheCausalLM",
    "UnsupportedModelError",
    "supported_model_types",
]
