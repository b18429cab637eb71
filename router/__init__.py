"""The router: the I/O around a routing decision.

One request flow, top to bottom (each step its own module):

``requests``  parse_request(): one typed ParsedRequest, client routing fields stripped; ``surfaces``
              reads each generation surface's prompt once (``anthropic_prompt``, ``responses_prompt``
              convert /v1/messages and /v1/responses to the chat request vLLM renders)
``facts``     tokens -> block keys -> index lookup -> conversation entry (FactGatherer)
``flow``      RequestFlow: decide (policy) -> rewrite -> forward -> report, retry before any byte
``kv_params`` the kv_transfer_params bodies of each KV protocol (pure)
``forwarding``/``transport``  bytes to and from one worker (aiohttp or httpx)
``outcomes``  metrics and policy.observe once the answer is complete

Around it: ``registry`` (workers, health, load scraping), ``subscriptions`` (event subscribers kept in step
with the registry), ``tokens`` (per model: ``local_tokens``, ``plugin_tokens``, ``render_tokens``, remote
``/tokenize``; ``chat_prompt`` / ``chat_template`` / ``template_format`` render chat as vLLM does),
``conversations`` (multi-turn reuse store), ``app`` + ``http_body`` (the Starlette surface), ``extproc``
(Envoy's ext_proc, the same flow),
``admin`` / ``index_admin`` / ``explain`` (admin REST), ``state`` (the parts, built by
:mod:`kvroute.apps.build`), ``discovery`` (worker sources: Kubernetes, DNS, vLLM's event endpoints).

Arrows: router imports policies, indexer and the bottom layer (kvroute.config, kvroute.vocabulary,
kvroute.tasks); nothing below imports router. Processes live in kvroute.apps, not here.
Where a change goes: a new request field -> requests; a new KV step -> facts; a new body rule -> kv_params;
a new way to pick -> a policy (policies/), never this package.
"""
