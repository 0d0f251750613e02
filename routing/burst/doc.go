// Package burst keeps the replicas of a pool from sending a burst of
// requests to the same worker.
//
// # The problem
//
// Replicas share their decisions (routing/sync), but a decision reaches
// the peers only after the sync delay d (batching plus transit). Two
// decisions made less than d apart on two replicas are blind to each
// other: both replicas see the same fleet and, with the same policy,
// choose the same worker. On arrivals spread in time that is rare. In a
// burst — an agent fanning out parallel tool calls, a batch job, a retry
// storm after a worker died, a trace stamped on a coarse grid — every
// replica sends its share of the burst to the worker that looked best,
// and the synced pool does worse than replicas that share nothing.
//
// # Turns
//
// A burst reaches every replica at the same moment, so a decision can
// wait for its replica's turn: replica r (its place among the pool's live
// replicas, ordered by id) decides r·Step after its request arrived, with
// Step just over d. Replica 0 decides at once, replica 1 after the
// decisions of replica 0's share of the burst have reached it, and so on:
// within the burst the pool decides in turn, as one replica would, each
// seeing the others' choices. The wait is at most (MaxTurns−1)·Step (three
// steps of about 3 ms for four replicas), against TTFTs in hundreds of
// milliseconds when a burst herds.
//
// Waiting only helps in a burst: with arrivals spread in time a replica's
// turn shifts its decisions without making any peer's visible sooner (the
// decisions blind to it are as many), so the wait would be pure cost.
// The [Meter] tells the two apart from what a replica can know. At every
// arrival it counts the replica's own arrivals of the last 2d; over a
// recent horizon (10 s) the mean of that count, less what the replica's
// own arrival rate alone would give (rate·2d for arrivals spread at
// random), is how clustered its arrivals are. Requests enter the replicas
// at random, so a peer's arrivals cluster around ours as ours do, in the
// proportion of the peers' decision rate to our own (peers' decisions
// arrive over sync): Simultaneous estimates the peers' decisions made
// blind to one of ours beyond chance. Turns start when it is at least
// Threshold (1: a peer decision per decision) and stop when it falls
// back. A lone replica (no peer decisions), smooth traffic at any rate
// and a replica with too few arrivals to tell never wait.
//
// The Meter also counts, at every peer decision's arrival, this replica's
// own decisions of the last 2d: each is a pair of mutually blind
// decisions. Blind (pairs per own decision) is what is left of the
// problem with turns on; it is exported as a metric.
//
// # Concurrency
//
// A Meter is lock-free (atomics only) and safe for concurrent use; its
// times come from the caller (the engine's injected clock), so the
// simulator drives it in virtual time.
package burst
