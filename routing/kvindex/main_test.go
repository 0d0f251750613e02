package kvindex

import (
	"testing"

	"go.uber.org/goleak"
)

// The real clock runs expiry sweeps on timer goroutines; Close must stop them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
