package simworker

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-zeromq v0.17.0 PUB sockets can leave their writer goroutine
		// behind: run() checks `closed` only after a Wait, so a Close that
		// lands while it is sending is never noticed (see
		// routing/kvevents/main_test.go). Nothing of ours is left.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}
