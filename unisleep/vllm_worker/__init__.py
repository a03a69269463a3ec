"""What vLLM loads inside its processes: the general plugin (:mod:`.plugin`, run by vLLM in the
API server, the engine core and every worker), the sleep-mode allocator (:mod:`.allocator`) and
backend (:mod:`.sleep_backend`), the ``unisleep`` weight-transfer engine (:mod:`.transfer_engine`)
and worker extension (:mod:`.extension`) with the receiving session they share
(:mod:`.receiver`), the methods unisleep calls in workers by name (:mod:`.methods`) and the
table of vLLM versions and their known bugs (:mod:`.versions`).  What drives vLLM from outside
(HTTP, in process, AsyncLLM, a local server, the trainer side) is in :mod:`unisleep.engines`."""
