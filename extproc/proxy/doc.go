// Package proxy is kvbandit's standalone OpenAI-compatible reverse proxy
// (`kvbandit serve --http-addr`): it routes with the engine in-process, with
// no Envoy and no gRPC hop, for users who run kvbandit without a gateway.
//
// # Overview
//
// [Proxy] is an http.Handler for the /v1/ tree:
//
//   - POST /v1/chat/completions and POST /v1/completions are parsed,
//     tokenized and routed exactly as on the ext_proc path
//     ([extproc.ParseRequest], [extproc.TokenizeRequest]: the same hints from
//     x-prefix-* headers and nvext, the same byte-estimate fallback), then
//     forwarded to http://<endpoint> with the body bytes as received.
//   - GET /v1/models ([ModelsPath]) and GET /v1/models/{id} are answered by
//     the proxy with the fleet's models: what discovery declares for each
//     endpoint and what each worker answers on its own /v1/models (cached,
//     bounded in time and size), deduplicated and sorted.
//   - Any other /v1/ path (/v1/embeddings, ...) is routed by load only, as
//     ext_proc routes it, and passed through. A method other than POST on
//     a completion path is 405 (extproc.CheckMethod), as on ext_proc.
//   - POST /v1/route ([RoutePath]) answers, for a body that is a normal chat
//     or completion request, the endpoint that would be chosen and the
//     per-endpoint scores, through [routing.Scorer] (Engine.Score): no slot
//     accounting, no reuse budget spent, no learning. It is the reference
//     standalone router's best_worker_id.
//
// Paths are decoded once and cleaned first ([CleanPath]): encoded slashes,
// backslashes, percent signs and dot segments are refused (400
// invalid_path), dot segments and repeated slashes resolved, and the result
// must lie under /v1/ (404 not_found). The cleaned path is what is
// classified, routed and forwarded; the raw one never reaches a worker.
//
// Every input is bounded before it costs memory or time: request headers
// by the http.Server ([MaxHeaderBytes], set by serve), concurrent requests
// by Config.MaxInflight (503 too_many_requests_in_flight, before any body
// byte is read), the body by MaxBodyBytes (413), by the decision deadline
// (Config.DecisionTimeout, request headers → decision, body read included:
// 503 decision_timeout) and by the buffer budget (Deps.Budget, shared with
// the ext_proc server: 503 server_busy). The body buffer grows with the
// bytes received, never with a declared Content-Length; each chunk is
// charged to the budget as it arrives and released once the worker has
// answered. A worker's response headers are bounded by
// [MaxResponseHeaderBytes].
//
// Errors are the ext_proc path's: [extproc.Reject] maps them to a status and
// [extproc.Rejection.Body] writes the OpenAI-style JSON error body, with the
// code in the x-kvbandit-error header. Errors only the proxy meets (the
// worker cannot be reached, a path outside /v1/, a wrong method on
// /v1/route) are [extproc.Rejection] values built here, which Reject passes
// through unchanged.
//
// Responses are streamed: every chunk read from the worker is written and
// flushed at once (SSE is never buffered). The proxy adds the response
// header x-kvbandit-endpoint ([HeaderEndpoint]) naming the endpoint that
// served the request — the proxy dialled it itself, so chosen and served
// are the same — and sends the worker x-gateway-destination-endpoint (and
// x-data-parallel-rank for a data-parallel rank) as a gateway would.
// Client-supplied x-gateway-destination-endpoint*, x-data-parallel-rank and
// x-kvbandit-* headers are dropped. Hop-by-hop headers are removed both
// ways; compression is left to the client and the worker (the transport
// neither asks for nor undoes it).
//
// # Concurrency
//
// ServeHTTP runs on the http.Server's goroutine per request and shares only
// the engine (lock-free picks), the tokenizer and one http.Transport
// (keep-alive connections to the workers).
//
// # Lifecycle
//
// A request's decision is made once the body is read and parsed. From then
// on exactly one Decision.Done ends it, on every path: the response ended
// (success below 400, upstream_error from 400 on), the worker could not be
// reached (upstream_error with status 0, answered 503 upstream_unavailable),
// the worker's body broke off (upstream_error; the client connection is
// aborted so the client sees a truncated response), the client went away
// (cancelled), or [Proxy.Stop] cut the request at shutdown (abandoned). The
// outcome carries the status, the time to the first generated content
// (SSE: the first chunk with content; JSON: the first body byte of a 2xx),
// the usage the worker reported (prompt, completion and cached tokens) and
// the served endpoint.
//
// At shutdown the http.Server stops accepting and lets in-flight requests
// run for the drain timeout; then [Proxy.Stop] cancels the ones left and
// [Proxy.Wait] waits for their handlers.
package proxy
