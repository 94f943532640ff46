"""The CPU inference engine (`rlorch serve`): SGLang's native HTTP API over a transformers model."""
