"""rlorch's inference engine (`rlorch serve`), on the CPU or a GPU: SGLang's native HTTP API (and
OpenAI-compatible ``/v1`` routes, ``openai_routes``) over rlorch's own Qwen2 or a transformers
model (``model.implementation``); and ``fleet`` (`rlorch fleet`), many simulated engines behind the
same API for scale benchmarks."""
