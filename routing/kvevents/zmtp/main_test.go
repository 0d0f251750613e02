package zmtp

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-zeromq v0.17.0 PUB sockets (the interop tests' publishers)
		// can leave their writer goroutine behind: run() checks `closed`
		// only after a Wait, so a Close that lands while it is sending is
		// never noticed.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}
