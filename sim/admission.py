"""Admission control as vLLM >= 0.32's API server does it, over all data-parallel ranks of a worker.

``max_num_queued_reqs`` caps the unfinished requests (waiting + running, ``n`` slots each):
``current + n > max`` is refused. ``max_num_queued_tokens`` caps the prompt tokens of requests still in
their prefill phase (the whole prompt counts until the first output token, cached or not):
``current >= max`` is refused, whatever the new prompt's size. A refusal is an HTTP 503 before any
byte, with vLLM's message, and counts in ``vllm:admission_rejections_total{model_name, reason}``.

Read from vLLM 0.33.0 (and 0.32.0, identical): ``AsyncLLM.check_admission`` in
``vllm/v1/engine/async_llm.py``, ``OutputProcessor.get_num_queued_tokens`` in
``vllm/v1/engine/output_processor.py``, ``QueueOverflowError`` / ``MaxQueuedTokensError`` in
``vllm/exceptions.py``, ``create_error_response`` in
``vllm/entrypoints/serve/exception_handling/error_response.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.sim.metrics import MetricFamilies

QUEUE_FULL_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
TOKENS_FULL_MESSAGE = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
)
#: vLLM's error ``type`` for a ``GracefulHTTPError``: the HTTP phrase of its status.
REJECTION_TYPE = "Service Unavailable"


class AdmissionRejected(Exception):
    """A full server: answered 503 with :attr:`message` (vLLM's) before anything is sent."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class Ticket:
    """One admitted request's share of the counters; released exactly once."""

    control: AdmissionControl
    slots: int
    prompt_tokens: int
    prefilling: bool = True
    done: bool = False

    def first_token(self) -> None:
        """The request left its prefill phase: its prompt no longer counts as backlog."""
        if self.prefilling and not self.done:
            self.prefilling = False
            self.control.prefill_tokens -= self.prompt_tokens

    def release(self) -> None:
        if self.done:
            return
        self.first_token()
        self.done = True
        self.control.requests -= self.slots


class AdmissionControl:
    def __init__(
        self,
        max_num_queued_reqs: int | None,
        max_num_queued_tokens: int | None,
        families: MetricFamilies,
    ) -> None:
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.families = families
        #: Unfinished requests (vLLM: ``get_num_unfinished_requests``) and their prompts still in prefill.
        self.requests = 0
        self.prefill_tokens = 0

    def check(self, n: int = 1) -> None:
        """Raise :class:`AdmissionRejected` (and count it) when a limit is reached."""
        if self.max_num_queued_reqs is not None and self.requests + n > self.max_num_queued_reqs:
            self.families.admission_rejected("max_num_queued_reqs")
            raise AdmissionRejected("max_num_queued_reqs", QUEUE_FULL_MESSAGE)
        if self.max_num_queued_tokens is not None and self.prefill_tokens >= self.max_num_queued_tokens:
            self.families.admission_rejected("max_num_queued_tokens")
            raise AdmissionRejected("max_num_queued_tokens", TOKENS_FULL_MESSAGE)

    def admit(self, prompt_tokens: int, n: int = 1) -> Ticket:
        """Count an admitted request until :meth:`Ticket.release` (right after :meth:`check`, no await
        between them, as vLLM registers the request before its first await)."""
        self.requests += n
        self.prefill_tokens += prompt_tokens
        return Ticket(self, n, prompt_tokens)
