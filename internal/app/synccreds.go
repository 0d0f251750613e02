package app

import (
	"errors"
	"fmt"
	"os"

	rsync "github.com/kvbandit/kvbandit/routing/sync"
)

// syncCredentialsFromEnv fills the NATS user, password and token the
// config leaves empty from KVBANDIT_SYNC_NATS_USER, _PASSWORD and _TOKEN
// (a Kubernetes Secret, as the Helm chart passes them).
func syncCredentialsFromEnv(n SyncNATSConfig) SyncNATSConfig {
	for _, e := range []struct {
		v   *string
		env string
	}{{&n.User, "KVBANDIT_SYNC_NATS_USER"}, {&n.Password, "KVBANDIT_SYNC_NATS_PASSWORD"}, {&n.Token, "KVBANDIT_SYNC_NATS_TOKEN"}} {
		if *e.v == "" {
			*e.v = os.Getenv(e.env)
		}
	}
	return n
}

// errSyncNoCredentials says how to fix a sync set-up without credentials.
const errSyncNoCredentials = "--sync-nats (sync.nats.servers) needs NATS credentials, so that only the pool's replicas can act as peers: " +
	"set sync.nats user and password, token, nkey_file (an nkey seed) or creds_file in --config " +
	"(or KVBANDIT_SYNC_NATS_USER and KVBANDIT_SYNC_NATS_PASSWORD, or KVBANDIT_SYNC_NATS_TOKEN), " +
	"or an mTLS client certificate (sync.nats.tls cert and key); " +
	"--sync-allow-anonymous (sync.allow_anonymous: true) connects without them and lets any client of the NATS server act as a peer"

// syncConfigError maps rsync.New's error to a usage error; a missing
// credential names the fix.
func syncConfigError(err error) error {
	if errors.Is(err, rsync.ErrNoCredentials) {
		return fmt.Errorf("%w: sync: %s", ErrUsage, errSyncNoCredentials)
	}
	return fmt.Errorf("%w: sync: %w", ErrUsage, err)
}

// checkSyncCredentials is config check's version of newSyncer's
// credentials rule: sync servers given (flag or config) without
// credentials or allow_anonymous are a usage error.
func checkSyncCredentials(o ServeOptions, cfg *FileConfig) error {
	if o.SyncNATS == "" && len(cfg.Sync.NATS.Servers) == 0 {
		return nil
	}
	n := syncCredentialsFromEnv(cfg.Sync.NATS)
	c := rsync.Config{CredsFile: n.CredsFile, User: n.User, Password: n.Password, Token: n.Token, NkeyFile: n.NkeyFile,
		TLS: rsync.TLSConfig{Cert: n.TLS.Cert}}
	if c.Anonymous() && !cfg.Sync.AllowAnonymous {
		return fmt.Errorf("%w: sync: %s", ErrUsage, errSyncNoCredentials)
	}
	return nil
}
