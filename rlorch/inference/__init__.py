"""Inference engines behind the Engine Protocol: the CPU engine (``rlorch serve``), the client for
SGLang's native HTTP API, the pool that routes across servers, and the launcher that starts them.

Heavy imports (torch, transformers) stay inside the modules that need them.
"""
