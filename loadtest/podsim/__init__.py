"""A stand-in for a vLLM OpenAI-compatible server, faithful on the wire, cheap on the CPU.

Modules: :mod:`~loadtest.podsim.engine` (batching, KV blocks, preemption; no sockets),
:mod:`~loadtest.podsim.words` (deterministic, resumable answers), :mod:`~loadtest.podsim.wire`
(vLLM's exact bytes), :mod:`~loadtest.podsim.faults` (fault knobs), :mod:`~loadtest.podsim.metrics`
(``/metrics``), :mod:`~loadtest.podsim.server` (aiohttp app), :mod:`~loadtest.podsim.cli` (flags) and
:mod:`~loadtest.podsim.launch` (:class:`PodsimProcess` for tests, demos and benchmarks).
"""
