// Package zmtp is a small, bounded implementation of ZMTP 3.x, the wire
// protocol of ZeroMQ (https://rfc.zeromq.org/spec/23/ and /spec/37/), with
// the NULL security mechanism only: the part that vLLM's and
// llm-d-inference-sim's KV-event publishers speak.
//
// # Overview
//
// It provides a SUB socket ([Sub]) that connects to a publisher, retrying
// with backoff until it is closed, or binds and accepts many publishers at
// once; and a DEALER connection ([DialDealer]) for vLLM's replay ROUTER.
// [Reader] parses frames, messages and commands from any io.Reader and is
// what every connection uses; it is a pure function of its input, so it is
// fuzzed directly.
//
// Every length a peer declares is checked against [Limits] before
// anything is allocated, and a frame's body is read in chunks as its bytes
// arrive, so memory follows what a peer actually sent, never what it
// claims it will send. Handshakes run under a deadline, concurrently, and
// bound sockets cap their connections, so a peer that connects and says
// nothing delays nobody. ZMTP 3.1 peers are sent PINGs and dropped when
// silent; PINGs from any peer are answered. ZMTP 3.0 has no PING, so a
// 3.0 peer that handshakes and then says nothing cannot be found out; when
// a bound socket's connections are all taken, a new one takes the place of
// the one that has gone longest without a message, once that one has been
// silent for [Options.EvictAfter]. A real publisher sends whenever it has
// news and reconnects when dropped, so silent squatters cannot keep it
// out.
//
// Subscriptions are sent as ZMTP 3.0 subscription messages (a first byte
// of 1, then the topic), which go-zeromq accepts and libzmq's XPUB accepts
// from 3.0 and 3.1 peers alike.
//
// # Concurrency
//
// A [Sub] runs one goroutine per connection (plus one accept or dial
// loop) and calls its message handler from them, concurrently when bound.
// A [Conn]'s Recv must be called from one goroutine; Send, heartbeats and
// answers to PINGs are serialised by a mutex. Close may be called from any
// goroutine and waits for every goroutine it owns.
package zmtp
