// Package latency is an online-learned latency model of an inference
// fleet: it predicts a request's time to first token (TTFT) on each
// candidate (endpoint, data-parallel rank), split into the wait for the
// work already ahead of it and its own prefill, and the delay its prefill
// adds to the sequences decoding there.
//
// The model follows the structure every chunked-prefill engine (vLLM,
// SGLang, Dynamo's mocker) shares, without its constants: a step runs at
// most BatchTokens prompt tokens, costs a fixed overhead plus a per-token
// time, prefill steps go before decode steps, and a decode step's time grows
// with the sequences running. For prefill work of W tokens (the in-flight
// prefill ahead of the request plus its own uncached tokens)
//
//	TTFT ≈ f_w · (a·W/B + b·⌈W/B⌉ + c + h·decode(running) + m·waiting_mem)
//
// where B is the batch budget, decode(running) = d0 + d1·running is the
// decode step in progress (learned from (E2E − TTFT)/(output − 1)), and
// waiting_mem the scraped waiting requests when the KV memory is nearly full
// (FCFS admission then blocks). The coefficients θ = (a, b, c, h, m) are
// pooled across the fleet: an exponentially weighted ridge regression
// (forgetting Forget per observation, pulled towards a prior so that a
// feature that stays 0 cannot wind up) solved after every outcome. f_w is
// the endpoint rank's speed factor relative to the pooled fit: a log-normal
// posterior whose precision is discounted by SpeedForget per observation,
// so that a cold endpoint starts at the fleet's estimate (f = 1) and
// Thompson sampling can draw from its uncertainty.
//
// Forgetting bound: at steady state each observation of an endpoint moves
// its mean log factor by a fraction (1 − SpeedForget) of its error, so
// after a step change in its speed the error left after n of its outcomes
// is SpeedForget^n of the change (without noise): with the default 0.9 an
// endpoint that halves (or recovers) its speed is known within 10% (in log
// space) after 22 of its requests ([Config.DetectWithin]; tested).
//
// Peers' outcomes (Observation.Remote, from active-active replicas) teach
// the speed factors only, each counting Config.RemoteWeight local ones.
// Each factor keeps its evidence apart by source (routing/evidence): this
// replica's outcomes with the prior, and each peer's. Every outcome of an
// endpoint, from any source, discounts every part by SpeedForget and adds
// its precision to its source's part, so the factor is exactly the single
// posterior above while every peer is there (each peer's part weighs its
// share of the endpoint's recent outcomes), and [Model.ForgetPeer] takes a
// peer's part out of every factor at once when it leaves. At most
// evidence.MaxPeers peers are kept apart (the least recently heard one is
// forgotten for a new one): a factor costs 56 bytes more, plus 32 to 50
// bytes per peer whose outcomes it learnt (8 to 13 KiB with all 256).
//
// Reads (Predict, Factor) are lock-free: the coefficients are an immutable
// value swapped atomically, the factors are per-candidate memos. Observe
// serialises writers and runs off the request path (in Decision.Done).
package latency
