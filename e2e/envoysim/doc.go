// Package envoysim is an HTTP reverse proxy that behaves like Envoy with the
// ext_proc HTTP filter in front of an override_host upstream cluster. It
// exists only for kvbandit's tests: no Envoy binary can be installed where
// they run, so the end-to-end suites drive the real kvbandit server through
// this proxy instead. Nothing outside tests may import it.
//
// # What it reproduces
//
// The exchange follows Envoy's ext_proc filter (source/extensions/filters/http/
// ext_proc, ext_proc.cc and processor_state.cc) and its documented protocol
// (external_processor.proto, processing_mode.proto):
//
//   - One Process stream per HTTP request. Headers are sent as HeaderValue
//     raw_value with the pseudo-headers (:authority, :path, :method, :scheme),
//     protocol_config on the first message only, metadata_context with the
//     forwarding namespaces on every message.
//   - FULL_DUPLEX_STREAMED: body chunks are sent as they arrive, without
//     waiting for the headers response; the server must answer the headers
//     first and then send the body back as StreamedBodyResponse chunks. What
//     the server does not send back never reaches the other side. A body
//     response before the headers response, or a BodyResponse without
//     streamed_response, is spurious. No message timeout. content-length is
//     removed (the body goes out chunked) and a content-length set by the
//     server is ignored, as Envoy does unless allow_content_length_header.
//     Once a body chunk went to the server, failure_mode_allow no longer
//     applies (Filter::failureModeAllow).
//   - BUFFERED: headers, wait for their response, then the whole body in one
//     message; the headers are held until the BodyResponse, whose
//     CommonResponse may mutate them. A body over BufferLimit gets a 413 local
//     reply. Each message has MessageTimeout (504 on expiry).
//   - NONE: headers only; the body goes straight to the upstream.
//   - Trailers are sent only when the HTTP message has trailers.
//   - Header mutations follow Envoy's default mutation rules: set_headers on
//     host, :authority, :method, :scheme and x-envoy-* are ignored, removing
//     host or a pseudo-header is ignored, `append` defaults to false
//     (append_action is not read, like Envoy's mutation_utils.cc), the value
//     comes from raw_value only.
//   - clear_route_cache is honoured only with a header mutation in the same
//     response (clear_route_cache_ignored otherwise).
//   - dynamic_metadata is applied (merged per key) only for receiving
//     namespaces; it is applied before the response is checked for being in
//     order, as Envoy does.
//   - ImmediateResponse: local reply with its status (200 when unset or
//     below 200), body and header mutations; the upstream is not contacted, or
//     is abandoned. After response headers went to the client, the client
//     connection is reset instead.
//   - A clean close (gRPC OK) by the server: processing stops and the rest of
//     the request and response pass through untouched; body bytes the server
//     had received but not sent back are lost, as in Envoy.
//   - A stream error or a spurious message: 500 local reply (or a reset of
//     the client connection once response headers were sent), unless
//     failure_mode_allow applies, in which case processing stops as for a
//     clean close.
//   - Envoy's stream-close optimisation: once the last expected response has
//     arrived, the stream is closed (half-close, then reset); it is also
//     closed when the HTTP request ends or the client goes away.
//
// Upstream selection is the override_host load-balancing policy with one
// metadata source, envoy.lb / x-gateway-destination-endpoint, never a header:
// the value is split on commas, whitespace-trimmed, and the first address
// that is a host of the cluster wins; an absent, empty, non-string or
// unparsable value, or one with no cluster host, falls back to round robin
// over the cluster. The chosen host is written to envoy.lb /
// x-gateway-destination-endpoint-served, which the response messages then
// carry in their metadata_context. The upstream is contacted over HTTP/1.1.
// Envoy's own local replies on the upstream side (no healthy upstream,
// connection failure) go through the response path like an upstream
// response, as they do through Envoy's encoder filters.
//
// # Ordering and recording
//
// Each request is run by one loop, like Envoy's dispatcher: helper
// goroutines only do I/O. Whatever the server has already sent (messages,
// the end of the stream) is handled before any later upstream or client
// event, as Envoy reads it off the connection in order; a server close that
// arrives after the response phase started is handled as Envoy would, data
// sent to the server and not returned being lost. Every message sent and
// received, and every decision the proxy takes, is an [Event]; each HTTP
// request is summarised as an [Exchange] ([Proxy.Exchanges],
// [Proxy.WaitExchanges]), and Config.Trace sees events as they happen.
//
// # Known simplifications
//
// No HTTP/2 downstream, no retries or hedging (later addresses of the
// destination list are never used; envoy/sidecar.yaml retries connect
// failures on them), no mode_override, no observability mode, no
// flow-control windows or watermarks. The fallback policy is round robin
// (envoy/sidecar.yaml uses least_request). The header filters of the
// shipped configuration are opt-in (Config.StripRequestHeaders,
// Config.RouteRemoveRequestHeaders). The 413 for a BUFFERED body
// over the buffer limit closes the ext_proc stream and is not sent through
// the response path. Round robin starts at the first host, not at a random
// one.
package envoysim
