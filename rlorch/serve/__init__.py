"""The CPU inference engine (`rlorch serve`): SGLang's native HTTP API over rlorch's own Qwen2 or
a transformers model (``model.implementation``)."""
