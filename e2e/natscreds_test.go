package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// The suites' nats-servers require credentials, as a deployment's should:
// `serve --sync-nats` refuses to start without them (issue 22).

// syncNATSUser and syncNATSPassword are the replicas' NATS credentials.
const (
	syncNATSUser     = "kvbandit"
	syncNATSPassword = "e2e-sync-secret"
)

// startSyncNATS starts a nats-server that requires the replicas'
// user and password.
func startSyncNATS(t *testing.T) *natsenv.Server {
	t.Helper()
	return natsenv.Start(t, natsenv.Options{User: syncNATSUser, Password: syncNATSPassword})
}

// syncNATSYAML is the config's sync.nats credentials, indented to go
// under a "sync:" line.
func syncNATSYAML() string {
	return fmt.Sprintf("  nats:\n    user: %q\n    password: %q\n", syncNATSUser, syncNATSPassword)
}

// syncConfigFile writes a config file whose sync section holds the
// credentials (and extra lines of the sync section, indented by two).
func syncConfigFile(t *testing.T, extra string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "sync.yaml")
	if err := os.WriteFile(p, []byte("sync:\n"+syncNATSYAML()+extra), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
