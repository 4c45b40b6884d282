"""``specdec serve``: the OpenAI-compatible HTTP server (:mod:`.server`), the API's request
and response shapes (:mod:`.openai_protocol`), its Prometheus ``/metrics``
(:mod:`.metrics`), and the engine behind it in a process of its own (:mod:`.async_engine`)."""
