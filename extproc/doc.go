// Package extproc is kvbandit's Envoy external-processing (ext_proc) server:
// the Gateway API Inference Extension endpoint picker protocol on top of
// envoy.service.ext_proc.v3.ExternalProcessor.
//
// # Overview
//
// Envoy opens one bidirectional Process stream per HTTP request. [Server]
// only receives, sends and maps errors; a [processor] made per stream holds
// the protocol state and handles each phase in its own method: request
// headers, request body, request trailers, response headers, response body,
// response trailers. The exchange is chosen per stream from the first
// message's protocol_config:
//
//   - FULL_DUPLEX_STREAMED (or absent): the request body is buffered to end
//     of stream (bounded by --max-body-bytes and a global byte budget), the
//     request is parsed and routed, then the headers response carries the
//     decision (x-gateway-destination-endpoint header, envoy.lb dynamic
//     metadata, clear_route_cache) and the original body bytes are streamed
//     back in chunks of at most 62,000 bytes.
//   - BUFFERED: the headers message is answered at once; the decision goes in
//     the one BodyResponse, body untouched.
//   - NONE, STREAMED, or request headers with end_of_stream: decided at the
//     headers. A request that has a body the mode hides (NONE, or STREAMED,
//     where header mutations in body responses are ignored) is routed on
//     what the headers carry: the hint headers, the path, and the model only
//     when x-gateway-model-name names it (else every endpoint is eligible);
//     no prompt tokens, so load and prefix or session affinity decide.
//     kvbandit warns once and counts such decisions in
//     kvbandit_decisions_without_body_total. STREAMED body chunks that
//     follow are acknowledged untouched.
//
// What a stream keeps from its request headers is bounded: the known hint
// headers only (each at most [MaxHintHeaderBytes]), the request id
// truncated to [MaxRequestIDBytes], the path to [MaxPathBytes] (after its
// kind is classified), at most [MaxSpoofedHeaders] spoofable header names
// (431 beyond); the hints and the tenant are dropped once decided.
//
// Response messages feed the decision's [routing.Outcome]: status, served
// endpoint, time to first token (from the SSE or JSON body), usage. Every
// error that the client should see becomes an ImmediateResponse with an
// OpenAI-style JSON body in exactly one function, [Reject].
//
// # Concurrency
//
// Each stream runs two goroutines: a reader that calls Recv and the
// stream's own loop, which selects on received messages, the header, idle
// and decision deadlines (timers of the injected clock), server drain and
// the stream context. The reader handles each message under the stream's
// lock and the loop takes the same lock before it acts, so the processor
// is used by one goroutine at a time and replies leave in headers → body →
// trailers order. Routing goes through [routing.Picker], which never
// blocks (but for its bounded admission queue).
//
// # Lifecycle
//
// A stream counts against --max-inflight from its request headers on, so
// a stream that opens and says nothing holds no slot; one that sends no
// request headers within --stream-header-timeout is closed with
// DEADLINE_EXCEEDED (there is no request to answer). The refusals of
// admission (503 too_many_requests_in_flight, shutting_down) answer the
// request headers. From the headers to the decision --decision-timeout
// applies (503). After the decision no deadline cuts a live response, but
// a stream that receives no message for --stream-idle-timeout (the data
// plane went silent) ends its decision as abandoned and closes cleanly, so
// that Envoy carries on without kvbandit; a dead peer is found sooner by
// the gRPC server's keepalive pings, which end the connection's streams.
//
// A stream's decision is made once (at body end of stream, at the headers,
// or never when the request is rejected). From then on exactly one call of
// Decision.Done ends it: at the end of the response (success or upstream
// error by status), when the stream context ends (client cancel or Envoy
// reset), when a protocol error aborts the stream, when the server's hard
// stop cuts it (abandoned), when the stream idles out (abandoned), or right
// after the request phase when response processing is turned off
// (abandoned: no outcome is observed).
//
// Closing a stream cleanly makes Envoy continue without the server, but in
// FULL_DUPLEX_STREAMED mode Envoy drops body chunks it has sent and not got
// back. So kvbandit never closes in the middle of a response body: on
// [Server.Drain] undecided streams are answered 503 and decided ones run to
// their end; with response processing off the stream closes early only when
// protocol_config says no response body will be sent (NONE).
package extproc
