"""One OpenTelemetry trace per request (issue 40), without the OpenTelemetry SDK at run time.

``context`` reads and writes W3C trace context and samples (pure), ``spans`` holds one request's spans
(pure), ``tracer`` starts a request's trace from the client's headers (pure), ``otlp`` encodes spans as an
OTLP/HTTP protobuf body by hand (pure), ``exporter`` sends them from a trio task through a bounded queue
that drops, and counts, what a slow or absent collector cannot take, and ``service`` is one process's
tracer and exporter, following reloads. What each request span records is ``narwhal.serving.request_spans``.
The SDK is not used: its span objects, processors and threaded synchronous exporter cost far more per
request than the issue's 10% budget, while plain slotted spans and a few hundred lines of protobuf writing
do the job; the tests decode what ``otlp`` writes with the official ``opentelemetry-proto`` messages.
"""
