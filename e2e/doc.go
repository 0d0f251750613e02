// Package e2e holds kvbandit's end-to-end suites. They build the real
// `kvbandit` binary, start it with real gRPC listeners, and drive it
// through envoysim (an Envoy-faithful ext_proc data plane, since no Envoy
// binary can run here) in front of real HTTP workers (package worker).
// The package has no code outside its tests.
package e2e
