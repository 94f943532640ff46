"""The client side of inference, behind the Engine Protocol: the client for SGLang's native HTTP API
(which `rlorch serve` speaks too), the pool that routes across servers, the launcher that starts
them, the simulated engine, and the backend registry. The CPU server itself is :mod:`rlorch.serve`.

Heavy imports (torch, transformers) stay inside the modules that need them.
"""
