package main

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-zeromq v0.17.0's PUB writer (the simulated workers' KV
		// events) can outlive Close: an upstream bug, see routing/kvevents.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}
