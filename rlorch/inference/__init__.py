"""The client side of inference, behind the Engine Protocol: the client for SGLang's native HTTP
API (which ``rlorch serve`` speaks too), the pool that routes across servers, the backend that
starts servers through a launcher and pools them (``servers``), the router stand-in, the
simulated engine, and the orchestrator's side of distributed weight transfer. The CPU server
itself is :mod:`rlorch.serve`.

Heavy imports (torch, transformers) stay inside the modules that need them.
"""
