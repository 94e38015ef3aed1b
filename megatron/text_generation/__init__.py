"""Text generation with a key/value cache across tensor and pipeline ranks, and Megatron's REST
server (``tools/run_text_generation_server.py``).

Modules: ``inference_params`` (the cache), ``sampling`` (greedy, temperature, top-k, top-p),
``generation`` (the step loop over the pipeline), ``api`` (the ``PUT /api`` request and
response), ``server`` (the HTTP server on rank 0 and the other ranks' loop), ``connections``
(its bound on connections served at once). Names are loaded on first use, so the model can
import the light ``inference_params`` without the rest.
"""

import importlib

_EXPORTS = {
    "InferenceParams": "megatron.text_generation.inference_params",
    "sample": "megatron.text_generation.sampling",
    "generate_tokens": "megatron.text_generation.generation",
    "score_tokens": "megatron.text_generation.generation",
    "GenerationError": "megatron.text_generation.generation",
    "GenerationRequest": "megatron.text_generation.api",
    "RequestError": "megatron.text_generation.api",
    "RequestTooLarge": "megatron.text_generation.api",
    "SamplingError": "megatron.text_generation.sampling",
    "GenerationFailed": "megatron.text_generation.server",
    "parse_request": "megatron.text_generation.api",
    "GenerationService": "megatron.text_generation.server",
    "MegatronServer": "megatron.text_generation.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron.text_generation' has no attribute {name!r}")
