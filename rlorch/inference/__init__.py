"""The client side of inference, behind the Engine Protocol: the client for SGLang's native HTTP
API (which ``rlorch serve`` speaks too: ``client``, with ``answers`` and ``scan`` reading its
/generate answers into arrays and ``control`` its control plane's connections), the pool that
routes across servers, the backend that starts servers through a launcher and pools them
(``servers``), the fleet grown or shrunk while a run goes (``scale``), sglang-router in front of
the servers (``routed``), the simulated engine, and the orchestrator's side of distributed weight
transfer. The CPU server
itself is :mod:`rlorch.serve`.

Heavy imports (torch, transformers) stay inside the modules that need them.
"""
