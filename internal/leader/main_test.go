package leader

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks for leaked goroutines. klog, imported by client-go,
// starts a flush daemon at init that never stops.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}
